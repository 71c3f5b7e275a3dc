"""``stagedserve chat`` and ``stagedserve complete``, driven through a pseudo-terminal against a real
server on tiny-chat (it answers "Add 4 and 5." with "9"): streaming replies, multi-turn history,
``/exit``, ``--quick``, and clear errors for a server that is not there or refuses the key."""

from __future__ import annotations

import argparse
import os
import sys

import pexpect
import pytest

from shared import Tokenizer, tiny_chat_model
from stage5_server.cli.client import resolve_connection
from stage5_server.server import create_app
from tests.stage5.server_fixtures import REPO, make_llm, metric, running_server

KEY = "test-key-cli-chat"
MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server():
    app = create_app(make_llm(tiny_chat_model(), max_model_len=320), api_keys={KEY: "cli"}, served_model_name=MODEL,
                     log_stats_interval=None)
    with running_server(app) as running:
        yield running


def spawn(*args: str, env: dict[str, str] | None = None) -> pexpect.spawn:
    clean = {k: v for k, v in os.environ.items() if k not in ("OPENAI_BASE_URL", "OPENAI_API_KEY",
                                                               "STAGEDSERVE_API_KEY")}
    return pexpect.spawn(sys.executable, ["-m", "stage5_server", *args], cwd=str(REPO), encoding="utf-8",
                         timeout=60, env={**clean, "PYTHONPATH": str(REPO), **(env or {})})


def finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def prompt_tokens_sum(url: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return metric(text, "vllm:request_prompt_tokens_sum") or 0.0


@pytest.mark.slow
def test_chat_streams_replies_keeps_the_history_and_exits_on_slash_exit(server):
    before = prompt_tokens_sum(server.url)
    # The key as stagedserve serve reads it ('KEY group=NAME'), the model from the server's list.
    child = spawn("chat", "--url", f"{server.url}/v1", "--temperature", "0", "--max-tokens", "8",
                  env={"STAGEDSERVE_API_KEY": f"{KEY} group=cli"})
    child.expect_exact(f"chat with '{MODEL}'")
    child.expect_exact("> ")
    child.sendline("Add 4 and 5.")
    child.expect_exact("9\r\n> ")
    child.sendline("What is 7 squared?")  # tiny-chat was trained on single turns: any reply will do
    child.expect(r"What is 7 squared\?\r\n\S+.*\r\n> ")
    child.sendline("/exit")
    assert finish(child) == 0
    # The second request carried the first turn and its reply: the server tokenized the whole history.
    tokenizer = Tokenizer(tiny_chat_model())
    first = [{"role": "user", "content": "Add 4 and 5."}]
    second = [*first, {"role": "assistant", "content": "9"}, {"role": "user", "content": "What is 7 squared?"}]
    expected = len(tokenizer.apply_chat_template(first)) + len(tokenizer.apply_chat_template(second))
    assert prompt_tokens_sum(server.url) - before == expected


@pytest.mark.slow
def test_quick_chat_and_complete_print_one_reply_and_exit(server):
    chat = spawn("chat", "--url", f"{server.url}/v1", "--api-key", KEY, "--model", MODEL, "--temperature", "0",
                 "-q", "Add 38 and 47.")
    chat.expect_exact("85\r\n")
    assert finish(chat) == 0
    prompt = "<|im_start|>user\nWhat is 6 squared?<|im_end|>\n<|im_start|>assistant\n"
    complete = spawn("complete", "--temperature", "0", "--max-tokens", "4", "--quick", prompt,
                     env={"OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": KEY})
    complete.expect_exact("36\r\n")
    assert finish(complete) == 0


@pytest.mark.slow
def test_complete_repl_continues_each_prompt_alone_and_ends_with_the_input(server):
    before = prompt_tokens_sum(server.url)
    child = spawn("complete", "--url", f"{server.url}/v1", "--api-key", KEY, "--temperature", "0",
                  "--max-tokens", "4")
    prompts = ["Add 2 and 2.", "Say: owl rain"]
    for prompt in prompts:
        child.expect_exact("> ")
        child.sendline(prompt)
        child.expect_exact(prompt + "\r\n")  # the terminal's echo, then the continuation
    child.expect_exact("> ")
    child.sendeof()  # Ctrl-D
    assert finish(child) == 0
    tokenizer = Tokenizer(tiny_chat_model())
    assert prompt_tokens_sum(server.url) - before == sum(len(tokenizer.encode(p)) for p in prompts)


def test_unreachable_server_and_refused_key_are_one_line_errors(server):
    child = spawn("chat", "--url", "http://127.0.0.1:9/v1", "-q", "hi")
    child.expect_exact("stagedserve chat: error: cannot reach http://127.0.0.1:9/v1")
    assert finish(child) == 1
    child = spawn("complete", "--url", f"{server.url}/v1", "--api-key", "wrong", "-q", "hi")
    child.expect_exact("stagedserve complete: error: the server answered 401")
    assert "Traceback" not in child.before
    assert finish(child) == 1


def test_connection_comes_from_flags_then_environment():
    args = argparse.Namespace(url=None, api_key=None)
    assert resolve_connection(args, {}) == ("http://127.0.0.1:8000/v1", "EMPTY")
    assert resolve_connection(args, {"STAGEDSERVE_API_KEY": "k1 group=ops,k2"}) == ("http://127.0.0.1:8000/v1", "k1")
    assert resolve_connection(args, {"STAGEDSERVE_API_KEY": "sk:whole"}) == ("http://127.0.0.1:8000/v1", "sk:whole")
    env = {"OPENAI_BASE_URL": "http://h:1/v1/", "OPENAI_API_KEY": "ok", "STAGEDSERVE_API_KEY": "k1"}
    assert resolve_connection(args, env) == ("http://h:1/v1", "ok")
    flags = argparse.Namespace(url="http://x:2/v1", api_key="flag")
    assert resolve_connection(flags, env) == ("http://x:2/v1", "flag")
