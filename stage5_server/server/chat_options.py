"""The operator's switches for chat: tool calling and the chat template (vLLM's flag names).

``--enable-auto-tool-choice`` with ``--tool-call-parser hermes`` reads ``tool_choice: "auto"``
calls out of the text; ``--trust-request-chat-template`` accepts a request's own template (code
the server runs); ``--allow-control-tokens-in-messages`` tokenizes control-token strings in
messages as the tokens themselves; without it a caller cannot forge a turn.

vLLM: ``vllm/entrypoints/openai/cli_args.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage5_server.server.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ChatOptions:
    enable_auto_tool_choice: bool = False  # ``tool_choice: "auto"`` reads calls out of the text
    tool_call_parser: str | None = None  # the format it reads them in (``TOOL_PARSERS``)
    trust_request_chat_template: bool = False  # a request's own ``chat_template`` is rendered
    control_tokens_in_messages: bool = False  # for trusted callers only: messages may write control tokens

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: unknown {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("tool_call_parser: --enable-auto-tool-choice needs --tool-call-parser")
