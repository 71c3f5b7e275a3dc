"""Tool calls read back out of the model's text, whole or as it streams.

With ``tool_choice: "auto"`` a model writes calls in its own format, named by
``--tool-call-parser``. Hermes (Qwen, Hermes, the tiny models' template) writes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A block is a call only if it names
one of the request's tools with an arguments object; anything else stays ``content``. Streaming
holds back text that may start a block and sends each call whole. ``required`` or a named tool
need no parser: structured output forces the JSON (``ForcedToolCalls``).

vLLM: ``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`` and ``abstract_tool_parser.py``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # the JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ParsedOutput:
    content: str | None  # None when the text held only tool calls
    tool_calls: list[ToolCall]


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def arguments_json(value: Any) -> str | None:
    """The JSON text of an arguments object; None unless ``value`` is an object (or a JSON string of one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: list[str]):
        self.tool_names = set(tool_names)

    def call(self, block: str) -> ToolCall | None:
        """The call in one block's text, or None if it is not a well-formed call of a known tool."""
        try:
            body = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(body, dict) or body.get("name") not in self.tool_names:
            return None
        arguments = arguments_json(body.get("arguments", body.get("parameters", {})))
        return None if arguments is None else ToolCall(body["name"], arguments)

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        whole = stream.feed(text)
        rest = stream.finish()
        content = whole.content + rest.content
        calls = whole.tool_calls + rest.tool_calls
        if calls:
            content = content.strip() or None
        return ParsedOutput(content, calls)

    def stream(self) -> HermesStream:
        return HermesStream(self)


class HermesStream:
    """One response's incremental parse: ``feed`` each text delta, then ``finish``."""

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self.buffer = ""  # text not yet sent: a partial "<tool_call>" or an open block
        self.in_block = False
        self.held_space = ""  # whitespace between calls, sent only if more text follows
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        start, end = self.parser.START, self.parser.END
        self.buffer += text
        delta = StreamDelta()
        while True:
            if self.in_block:
                close = self.buffer.find(end)
                if close == -1:
                    return delta
                block, self.buffer = self.buffer[len(start):close], self.buffer[close + len(end):]
                self.in_block = False
                call = self.parser.call(block)
                if call is None:  # not a call after all: it is text
                    self._text(delta, start + block + end)
                else:
                    self.held_space = ""
                    delta.tool_calls.append(call)
                    self.num_calls += 1
                continue
            opening = self.buffer.find(start)
            if opening != -1:
                self._text(delta, self.buffer[:opening])
                self.buffer, self.in_block = self.buffer[opening:], True
                continue
            keep = _partial_suffix(self.buffer, start)  # may still become "<tool_call>"
            self._text(delta, self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return delta

    def finish(self) -> StreamDelta:
        """The end of the text: an unclosed block or a held-back prefix is text after all."""
        delta = StreamDelta()
        self._text(delta, self.buffer)
        self.buffer, self.in_block = "", False
        if self.held_space and not self.num_calls:
            delta.content += self.held_space
        self.held_space = ""
        return delta

    def _text(self, delta: StreamDelta, text: str) -> None:
        if not text:
            return
        if not text.strip():
            self.held_space += text
            return
        delta.content += self.held_space + text
        self.held_space = ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}


# ---- calls forced by structured output ------------------------------------------------------------

def required_calls_schema(tools: list[dict]) -> dict:
    """``tool_choice: "required"``: a JSON array of calls, each naming a tool, arguments following its schema.
    A tool's ``$defs`` (``definitions``) move to the root, where its ``#/$defs/...`` pointers now lead
    (vLLM's ``get_tool_schema_defs``); two tools may share a name only for the same definition."""
    definitions: dict[str, dict] = {"$defs": {}, "definitions": {}}
    calls = []
    for t in tools:
        arguments = dict(parameters_schema(t))
        for keyword, found in definitions.items():
            defined = arguments.pop(keyword, None) or {}
            if not isinstance(defined, dict):
                raise ValueError(f"tools: {keyword} of {t['function']['name']!r} must be an object")
            for name, schema in defined.items():
                if found.setdefault(name, schema) != schema:
                    raise ValueError(f"tools: the definition {keyword}/{name} differs between tools; give "
                                     "each its own name")
        calls.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    return {**schema, **{keyword: found for keyword, found in definitions.items() if found}}


def parameters_schema(tool: dict) -> dict:
    params = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    return params if params.get("type") == "object" or "properties" in params else {**params, "type": "object"}


class ForcedToolCalls:
    """Reads the JSON that structured output forced: a named tool's arguments object, or (``required``) an array
    of ``{"name", "arguments"}``. A named call streams its arguments; ``required`` calls come when the text ends."""

    def __init__(self, name: str | None):
        self.name = name  # the named tool; None for "required"
        self.text = ""
        self.call: ToolCall | None = None

    def parse(self, text: str) -> ParsedOutput:
        calls = self._calls(text)
        return ParsedOutput(None if calls else text, calls)  # cut short (max_tokens): the text, no call

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        if self.name is None or not text:
            return StreamDelta()
        if self.call is None:
            self.call = ToolCall(self.name, text)
            return StreamDelta(tool_calls=[self.call])
        return StreamDelta(tool_calls=[ToolCall(self.name, text, id=self.call.id)])

    def finish(self) -> StreamDelta:
        if self.name is not None:
            return StreamDelta()
        calls = self._calls(self.text)
        return StreamDelta(content="" if calls else self.text, tool_calls=calls)  # as parse() answers

    def _calls(self, text: str) -> list[ToolCall]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []  # cut short (max_tokens): no call to report
        if self.name is not None:
            arguments = arguments_json(value)
            return [] if arguments is None else [ToolCall(self.name, arguments)]
        return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]
