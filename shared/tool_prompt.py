"""Tools described in the prompt by the server, for chat templates that cannot show them.

A model trained for tools has a chat template that writes the request's ``tools`` into the
prompt, an assistant's ``tool_calls`` as the model would write them, and ``tool`` results as
the model saw them in training. Many templates (SmolLM2-135M-Instruct's among them) do none of
this: they drop ``tools``, and fail on or drop the calls and results in the history. For such a
template the conversation is rewritten before rendering, in the Hermes format that Hermes and
Qwen2.5 templates produce and that ``--tool-call-parser hermes`` reads back:

- the tools, each one's JSON inside ``<tools></tools>``, with the instruction to answer with
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, in the first system message
  (after the caller's text) or in a new one;
- an assistant's ``tool_calls`` as ``<tool_call>`` blocks of JSON in its content;
- ``tool`` results as ``<tool_response>`` blocks in a user turn (consecutive results in one).

The rewritten text is message content like any other: the template writes its control tokens
around it, and the caller's text inside (tool definitions, arguments, results) stays text
(``shared/chat_template.py``). Whether a template shows tools is found by rendering a probe
conversation with and without a probe tool.

vLLM renders whatever the template makes of the tools (``apply_hf_chat_template`` in
``vllm/entrypoints/chat_utils.py``): a template that ignores them leaves the model blind to
them, and the operator is left to pass a tool-aware ``--chat-template`` such as
``examples/tool_chat_template_hermes.jinja``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("stagedserve")

TOOLS_INSTRUCTIONS = (
    "# Tools\n\nYou may call functions to help with the request. Their signatures are the JSON "
    "objects inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with its name and a JSON object of its arguments inside "
    "<tool_call></tool_call>, one block per call:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>"
)

_PROBE_NAME = "probe_tool_for_the_chat_template"
_PROBE_TOOLS = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "A probe.",
                                                  "parameters": {"type": "object", "properties": {}}}}]
_PROBE_MESSAGES = [{"role": "user", "content": "Hello."}]


def uses_tools(messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether the conversation needs a template that shows tools: tools, calls or results."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def template_shows_tools(render: Callable[..., str]) -> bool:
    """Whether ``render(messages, tools=...)`` (the chat template, rendering to text) writes the
    tools into the prompt: a probe tool's name appears with it, and the text differs without it.
    A template that raises on tools does not show them."""
    try:
        with_tools = render(_PROBE_MESSAGES, tools=_PROBE_TOOLS)
    except ValueError:
        return False
    try:
        without = render(_PROBE_MESSAGES, tools=None)
    except ValueError:
        without = None
    return _PROBE_NAME in with_tools and with_tools != without


def tools_block(tools: list[dict]) -> str:
    """The system text that describes ``tools`` in the Hermes format."""
    return TOOLS_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def describe_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as a template without tool support can render it: the tools in a system
    message, calls and results as text (the module docstring has the format)."""
    rewritten = history_as_text(messages)
    if not tools:
        return rewritten
    block = tools_block(tools)
    if rewritten and rewritten[0].get("role") in ("system", "developer"):
        first = rewritten[0]
        content = first.get("content") or ""
        return [{**first, "content": f"{content}\n\n{block}" if content.strip() else block}, *rewritten[1:]]
    return [{"role": "system", "content": block}, *rewritten]


def history_as_text(messages: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` as ``<tool_call>`` blocks in the content; ``tool`` results as
    ``<tool_response>`` blocks in a user turn, consecutive results sharing one."""
    out: list[dict] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
            continue
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            blocks = [f"<tool_call>\n{call_json(call)}\n</tool_call>" for call in calls]
            content = message.get("content") or ""
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join([content, *blocks] if content.strip() else blocks)
        out.append(message)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def call_json(call: dict) -> str:
    """One call as the model writes it: ``{"name": ..., "arguments": {...}}``."""
    function = call.get("function") or {}
    arguments: Any = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as the string it is
    return json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)


@functools.cache  # once per process: this is not a per-request log
def log_tools_described() -> None:
    logger.info("the chat template does not show tools: the server describes them in a system message "
                "(Hermes format, <tools> and <tool_call>) and writes tool calls and results as text")
