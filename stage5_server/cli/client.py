"""``stagedserve chat`` and ``stagedserve complete``: terminal clients for a running server.

    stagedserve chat [--url URL] [--api-key KEY] [--model NAME] [--system-prompt TEXT] [-q MESSAGE]
    stagedserve complete [--url URL] [--api-key KEY] [--model NAME] [-q PROMPT]

Both talk to any OpenAI-compatible server through the ``openai`` client and stream the tokens;
``chat`` keeps the conversation. ``/exit`` or Ctrl-D leaves; ``-q`` sends one message. Defaults:
``$OPENAI_BASE_URL`` (else ``http://127.0.0.1:8000/v1``), ``$OPENAI_API_KEY`` or the first of
``$STAGEDSERVE_API_KEY``, and the server's first model.

vLLM: ``vllm/entrypoints/cli/openai.py`` (``vllm chat``, ``vllm complete``).
"""

from __future__ import annotations

import argparse
import os
import sys

from stage5_server.arg_types import positive_int

DEFAULT_URL = "http://127.0.0.1:8000/v1"
EXIT_COMMANDS = ("/exit", "/quit")
PROMPT = "> "


def add_client_subcommands(subparsers) -> None:
    chat = subparsers.add_parser("chat", help="chat with a running server in the terminal",
                                 description="Chat with a running OpenAI-compatible server; /exit leaves.")
    _add_connection_args(chat)
    chat.add_argument("--system-prompt", default=None, help="a system message to start the conversation with")
    chat.add_argument("-q", "--quick", metavar="MESSAGE", default=None, help="send one message, print the reply, exit")
    chat.set_defaults(func=run_chat)
    complete = subparsers.add_parser("complete", help="complete prompts against a running server in the terminal",
                                     description="Continue prompts on a running OpenAI-compatible server; "
                                                 "/exit leaves.")
    _add_connection_args(complete)
    complete.add_argument("-q", "--quick", metavar="PROMPT", default=None, help="complete one prompt, print it, exit")
    complete.set_defaults(func=run_complete)


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"the server's API base (default: $OPENAI_BASE_URL or {DEFAULT_URL})")
    p.add_argument("--api-key", default=None,
                   help="the API key (default: $OPENAI_API_KEY, else the first key of $STAGEDSERVE_API_KEY)")
    p.add_argument("--model", "--model-name", dest="model", default=None,
                   help="the served model name (default: the server's first model)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="the longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")


def resolve_connection(args: argparse.Namespace, environ=os.environ) -> tuple[str, str]:
    """``(base_url, api_key)`` from the flags, else the environment."""
    url = args.url or environ.get("OPENAI_BASE_URL") or DEFAULT_URL
    key = args.api_key or environ.get("OPENAI_API_KEY")
    if not key and environ.get("STAGEDSERVE_API_KEY"):
        first = environ["STAGEDSERVE_API_KEY"].split(",")[0].strip()
        key = first.split()[0] if first else None  # 'KEY group=NAME' -> KEY (a colon is part of the key)
    return url.rstrip("/"), key or "EMPTY"  # the openai client wants a key even for an open server


def _connect(args: argparse.Namespace):
    import openai

    url, key = resolve_connection(args)
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    model = args.model or client.models.list().data[0].id
    options = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}
    return client, model, options


def _read(prompt: str) -> str | None:
    """One line from the user; ``None`` at the end of the input or an exit command."""
    try:
        line = input(prompt)
    except EOFError:
        print()
        return None
    return None if line.strip() in EXIT_COMMANDS else line


def _stream(chunks, text_of) -> str:
    """Print each chunk's text as it arrives; return all of it."""
    parts = []
    for chunk in chunks:
        text = text_of(chunk) if chunk.choices else None
        if text:
            parts.append(text)
            print(text, end="", flush=True)
    print(flush=True)
    return "".join(parts)


def run_chat(args: argparse.Namespace) -> int:
    def ask(client, model, options, messages) -> str:
        chunks = client.chat.completions.create(model=model, messages=messages, stream=True, **options)
        return _stream(chunks, lambda c: c.choices[0].delta.content)

    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    return _repl("chat", args, ask, messages)


def run_complete(args: argparse.Namespace) -> int:
    def ask(client, model, options, messages) -> str:
        chunks = client.completions.create(model=model, prompt=messages[-1]["content"], stream=True, **options)
        return _stream(chunks, lambda c: c.choices[0].text)

    return _repl("complete", args, ask, None)


def _repl(command: str, args: argparse.Namespace, ask, history: list[dict] | None) -> int:
    """Read, send, stream, repeat; ``history`` (chat) keeps every turn, ``None`` (complete) none."""
    import openai

    url = resolve_connection(args)[0]
    try:
        client, model, options = _connect(args)
        if args.quick is not None:
            ask(client, model, options, [*(history or []), {"role": "user", "content": args.quick}])
            return 0
        print(f"{command} with {model!r} at {client.base_url} (/exit or Ctrl-D leaves)")
        messages = list(history or [])
        while (line := _read(PROMPT)) is not None:
            turn = [*messages, {"role": "user", "content": line}]
            reply = ask(client, model, options, turn if history is not None else turn[-1:])
            if history is not None:
                messages = [*turn, {"role": "assistant", "content": reply}]
        return 0
    except KeyboardInterrupt:
        print()
        return 130
    except openai.APIConnectionError as exc:
        print(f"stagedserve {command}: error: cannot reach {url}: {exc}", file=sys.stderr)
    except openai.APIStatusError as exc:
        print(f"stagedserve {command}: error: the server answered {exc.status_code}: {exc.message}", file=sys.stderr)
    return 1
