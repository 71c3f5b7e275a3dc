"""The tool-call part of the chat request: ``tools``, ``tool_choice`` and an assistant's ``tool_calls``.

A tool is a function the model may call: a name and a JSON schema of its arguments object.
``tool_choice`` is ``none``, ``auto``, ``required`` or one named function; how each comes about
is ``chat.py``'s. A call sent back in ``messages`` carries its arguments as JSON text, which
must parse as an object. Parsed as strictly as every request model (``protocol.py``).

vLLM: the tool models of ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _ToolModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as protocol.StrictModel


class FunctionDefinition(_ToolModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_ToolModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolCallFunction(_ToolModel):
    name: str
    arguments: str  # the JSON text of an object


class AssistantToolCall(_ToolModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class NamedToolChoiceFunction(_ToolModel):
    name: str


class NamedToolChoice(_ToolModel):
    type: Literal["function"]
    function: NamedToolChoiceFunction


def arguments_object(arguments: str, index: int) -> dict:
    """A call's ``arguments`` text as the object it must be; ``index``: the call's place in ``tool_calls``."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"tool_calls[{index}].function.arguments: must be the JSON text of an object")
    return value


class ToolChoiceFields(_ToolModel):
    """The chat request's tool fields, checked against each other."""

    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call

    @model_validator(mode="after")
    def _tool_choice(self) -> ToolChoiceFields:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: {choice.function.name!r} is not one of the tools")
        if choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice: {choice!r} needs tools")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forced_tool_choice(self) -> bool:
        return self.tools is not None and (self.tool_choice == "required" or isinstance(self.tool_choice,
                                                                                        NamedToolChoice))

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the tool parsers read them."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
