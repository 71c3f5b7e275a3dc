"""How the server treats ``tools``: the operator's switches (``--enable-auto-tool-choice``,
``--tool-call-parser``).

vLLM: ``vllm/entrypoints/openai/cli_args.py`` (the same two flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from stage5_server.server.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ToolCallingOptions:
    enable_auto_tool_choice: bool = False  # ``tool_choice: "auto"`` reads calls out of the text
    tool_call_parser: str | None = None  # the format it reads them in (``TOOL_PARSERS``)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: unknown {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("tool_call_parser: --enable-auto-tool-choice needs --tool-call-parser")
