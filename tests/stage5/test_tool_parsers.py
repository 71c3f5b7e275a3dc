"""Tool calls read back out of text: the Hermes parser, whole and streamed, and forced calls."""

from __future__ import annotations

import json
import random

import pytest

from stage5_server.server.tool_parsers import ForcedToolCalls, HermesToolParser, required_calls_schema

PARSER = HermesToolParser(["get_weather", "add"])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(text: str, seed: int = 0):
    """Feed ``text`` in random pieces; return (content, calls) as a streaming client adds them up."""
    rng = random.Random(seed)
    stream, content, calls, i = PARSER.stream(), "", [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        delta = stream.feed(text[i:i + n])
        content, calls, i = content + delta.content, calls + delta.tool_calls, i + n
    delta = stream.finish()
    return content + delta.content, calls + delta.tool_calls


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", {"city": "Paris"})]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo"), None, [("get_weather", {"city": "Paris"}),
                                                         ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("add", {"a": 1})]),
    ('<tool_call>{"name": "add", "parameters": {"a": 2}}</tool_call>', None, [("add", {"a": 2})]),
    ("No tools needed.", "No tools needed.", []),
])
def test_hermes_blocks_become_calls_and_the_rest_stays_content(text, content, calls):
    whole = PARSER.parse(text)
    assert whole.content == content
    for parsed_content, parsed_calls in [(whole.content, whole.tool_calls), *[streamed(text, s) for s in range(5)]]:
        # A stream cannot take back the newline it sent before a call; it sends no blank content.
        assert (parsed_content.strip() if calls and parsed_content else parsed_content or None) == content
        assert [(c.name, json.loads(c.arguments)) for c in parsed_calls] == calls
        assert all(c.id.startswith("call_") for c in parsed_calls)


@pytest.mark.parametrize("block", [
    '{"name": "get_weather", "arguments": "Paris"}',  # arguments not an object: vLLM sent "\"Paris\""
    '{"name": "get_weather", "arguments": [1, 2]}',
    '{"name": "unknown_tool", "arguments": {}}',
    '{"name": "get_weather", "arguments": {"city": "Par',  # not JSON
    'not json at all',
])
def test_a_block_that_is_not_a_well_formed_call_stays_text(block):
    text = f"<tool_call>{block}</tool_call>"
    parsed = PARSER.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    assert streamed(text) == (text, [])


def test_an_unclosed_block_or_a_lone_prefix_is_text_when_the_output_ends():
    for text in ["Hi <tool_call>{\"name\": \"add\", \"arguments\": {", "Hi <tool_c", "a < b"]:
        assert PARSER.parse(text).content == text and streamed(text) == (text, [])


def test_streaming_holds_back_only_what_may_start_a_block():
    stream = PARSER.stream()
    assert stream.feed("Sure <tool").content == "Sure "
    assert stream.feed("bar").content == "<toolbar"
    delta = stream.feed(" " + CALL)
    assert delta.content == "" and [c.name for c in delta.tool_calls] == ["get_weather"]


def test_a_named_tool_streams_its_arguments_under_one_id():
    forced = ForcedToolCalls("get_weather")
    deltas = [forced.feed(piece) for piece in ['{"ci', 'ty": "Pa', 'ris"}']] + [forced.finish()]
    calls = [c for d in deltas for c in d.tool_calls]
    assert len({c.id for c in calls}) == 1 and "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    assert [(c.name, c.arguments) for c in ForcedToolCalls("get_weather").parse('{"city": "Paris"}').tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]


def test_required_calls_are_a_json_array_following_each_tools_schema():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
             {"type": "function", "function": {"name": "now"}}]
    schema = required_calls_schema(tools)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}]'
    forced = ForcedToolCalls(None)
    assert forced.feed(text).tool_calls == []
    assert [(c.name, c.arguments) for c in forced.finish().tool_calls] == [("add", '{"a": 1}'), ("now", "{}")]
    assert ForcedToolCalls(None).parse('[{"name": "add", "argu').tool_calls == []  # cut short: no call
