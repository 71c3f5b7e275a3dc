"""Tools described by the server on a chat template that cannot show them: the Hermes block
appears exactly once, calls and results in the history become text that the hermes parser reads
back, and templates that show tools are left alone."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from shared import tiny_chat_model
from shared.chat_template import apply_chat_template
from shared.tool_prompt import describe_tools, log_tools_described, template_shows_tools, tools_block
from stage5_server.server.tool_parsers import HermesToolParser
from tests.shared.test_chat_template import NAMES_TEMPLATE, PLAIN_CHATML, TOOLS, conversation

# In the manner of SmolLM2-135M-Instruct's template: text joined with "+" (so a null content
# fails), a default system turn when the conversation has none, no tools.
CONCAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REFUSING_TEMPLATE = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + PLAIN_CHATML
NO_TOOLS = [PLAIN_CHATML, CONCAT_TEMPLATE, REFUSING_TEMPLATE]


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(tiny_chat_model())


def rendered(hf, messages, **kwargs) -> str:
    return hf.decode(apply_chat_template(hf, messages, **kwargs))


def turns(text: str) -> list[tuple[str, str]]:
    """(role, content) of each turn of a ChatML rendering."""
    pieces = [p.split("<|im_end|>")[0] for p in text.split("<|im_start|>")[1:]]
    return [tuple(p.split("\n", 1)) if "\n" in p else (p, "") for p in pieces]


def test_the_probe_tells_templates_that_show_tools_from_those_that_cannot(hf):
    def render(template):
        return lambda messages, tools: hf.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True)

    assert template_shows_tools(render(None)) and template_shows_tools(render(NAMES_TEMPLATE))
    assert not any(template_shows_tools(render(t)) for t in NO_TOOLS[:2])


@pytest.mark.parametrize("template", NO_TOOLS, ids=["plain-chatml", "concat", "refuses-tools"])
def test_the_tools_block_appears_once_after_the_system_text(hf, template):
    text = rendered(hf, conversation(), tools=TOOLS, chat_template=template)
    assert text.count(tools_block(TOOLS)) == 1 and text.count("\n<tools>\n") == 1
    with_system = turns(text)
    assert [role for role, _ in with_system].count("system") == 1
    role, system = with_system[0]
    assert role == "system" and system == f"Be brief. Paris\n\n{tools_block(TOOLS)}"
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in listed.splitlines()] == TOOLS
    without_system = turns(rendered(hf, conversation()[1:], tools=TOOLS, chat_template=template))
    assert without_system[0] == ("system", tools_block(TOOLS))  # a system turn of its own, before the user's
    assert [role for role, _ in without_system].count("system") == 1


@pytest.mark.parametrize("template", NO_TOOLS, ids=["plain-chatml", "concat", "refuses-tools"])
def test_calls_and_results_in_the_history_round_trip_as_hermes_text(hf, template):
    history = conversation()
    text = rendered(hf, history, tools=TOOLS, chat_template=template)
    got = turns(text)
    assert [role for role, _ in got] == ["system", "user", "assistant", "user", "assistant", "user", "user",
                                         "assistant"]  # each result a user turn; the generation prompt last
    parser = HermesToolParser(["get_weather"])
    for (_, content), sent in zip([t for t in got if t[0] == "assistant"], [history[2], history[4]]):
        parsed = parser.parse(content)
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in sent["tool_calls"]]
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
            [(n, json.loads(a) if isinstance(a, str) else a) for n, a in want]
        assert parsed.content == (sent["content"] or None)
    assert got[3][1] == "<tool_response>\n18 C in Paris\n</tool_response>"
    assert got[5][1] == "<tool_response>\nParis\n</tool_response>"


def test_consecutive_results_share_one_user_turn():
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
             for i, c in enumerate(["Paris", "Rome"])]
    messages = [{"role": "user", "content": "Both?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c0", "content": "18 C"},
                {"role": "tool", "tool_call_id": "c1", "content": "25 C"}]
    described = describe_tools(messages, None)
    assert described[1]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                       '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                                       '{"city": "Rome"}}\n</tool_call>')
    assert described[2:] == [{"role": "user", "content": "<tool_response>\n18 C\n</tool_response>\n"
                                                         "<tool_response>\n25 C\n</tool_response>"}]


def test_a_template_that_shows_tools_renders_them_itself(hf):
    messages = conversation()
    ours = rendered(hf, messages, tools=TOOLS)
    theirs = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and tools_block(TOOLS) not in ours


def test_a_conversation_without_tools_is_not_rewritten(hf):
    messages = [{"role": "user", "content": "Add 4 and 5."}]
    assert rendered(hf, messages, chat_template=CONCAT_TEMPLATE) == hf.apply_chat_template(
        messages, chat_template=CONCAT_TEMPLATE, tokenize=False, add_generation_prompt=True)


def test_describing_the_tools_is_logged_once(hf, caplog):
    log_tools_described.cache_clear()
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        for _ in range(2):
            apply_chat_template(hf, conversation(), tools=TOOLS, chat_template=PLAIN_CHATML)
    assert sum("does not show tools" in r.getMessage() for r in caplog.records) == 1
