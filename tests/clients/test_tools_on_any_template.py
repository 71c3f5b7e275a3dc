"""Tool calling through real clients on a model whose chat template cannot show tools: the server
describes them itself (``shared/tool_prompt.py``), so ``tool_choice: "auto"`` (what langchain's
``bind_tools``, litellm, the OpenAI Agents SDK and pydantic-ai send) is answered, not refused.
Fast on a tiny Llama whose template is plain ChatML; once, slow, on the default model
(SmolLM2-135M-Instruct) through ``stagedserve serve``."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from shared import Tokenizer
from shared.tool_prompt import describe_tools
from tests.clients.conftest import TOOLS_KEY as KEY
from tests.clients.conftest import TOOLS_MODEL as MODEL
from tests.clients.test_structured_output_and_tools import ASK, Forecast, get_weather, weather_tool
from tests.stage5.server_fixtures import serving_or_exited, spawn_serve, stop_serve, wait_until

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city.",
                                           "parameters": Forecast.model_json_schema()}}]


@pytest.fixture
def client(plain_chatml_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{plain_chatml_server}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def described_length(checkpoint, messages: list[dict], tools: list[dict] | None) -> int:
    """Tokens of the conversation on the checkpoint's own template once the tools, calls and
    results are written as text."""
    hf = Tokenizer(checkpoint).hf
    text = hf.apply_chat_template(describe_tools(messages, tools), tokenize=False, add_generation_prompt=True)
    return len(hf.encode(text, add_special_tokens=False))


def valid_calls_or_text(message) -> bool:
    """What a client gets from ``auto``: calls of the tool whose arguments follow its schema, or text."""
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather"
        Forecast.model_validate_json(call.function.arguments)
    return bool(message.tool_calls) or isinstance(message.content, str)


def test_openai_auto_tool_choice_on_a_template_without_tools_shows_them_to_the_model(client, plain_chatml_checkpoint):
    messages = [{"role": "user", "content": ASK}]
    want = described_length(plain_chatml_checkpoint, messages, TOOLS)
    for tool_choice in ({}, {"tool_choice": "auto"}):  # auto is the default when tools are sent
        completion = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8,
                                                    temperature=0, **tool_choice)
        assert completion.usage.prompt_tokens == want  # the tools described in the prompt
        assert valid_calls_or_text(completion.choices[0].message)


def test_openai_tool_round_trip_on_a_template_without_tools(client, plain_chatml_checkpoint):
    messages = [{"role": "user", "content": ASK}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300, temperature=0)
    [call] = first.choices[0].message.tool_calls
    arguments = Forecast.model_validate_json(call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": get_weather(arguments.city, arguments.days)}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    assert second.usage.prompt_tokens == described_length(plain_chatml_checkpoint, messages, TOOLS)
    assert valid_calls_or_text(second.choices[0].message)


def test_langchain_bind_tools_auto_on_a_template_without_tools(plain_chatml_server):
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    chat_model = ChatOpenAI(model=MODEL, base_url=f"{plain_chatml_server}/v1", api_key=KEY, max_tokens=60,
                            temperature=0, max_retries=0)
    answer = chat_model.bind_tools([weather_tool()]).invoke(ASK)
    assert isinstance(answer, AIMessage) and answer.usage_metadata["input_tokens"] > 100
    for call in answer.tool_calls:
        assert call["name"] == "get_weather" and Forecast.model_validate(call["args"])


def test_litellm_tools_with_the_default_tool_choice_on_a_template_without_tools(plain_chatml_server,
                                                                                plain_chatml_checkpoint):
    import litellm

    messages = [{"role": "user", "content": ASK}]
    response = litellm.completion(model=f"hosted_vllm/{MODEL}", api_base=f"{plain_chatml_server}/v1", api_key=KEY,
                                  messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert response.usage.prompt_tokens == described_length(plain_chatml_checkpoint, messages, TOOLS)
    assert valid_calls_or_text(response.choices[0].message)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_langchain_and_pydantic_ai_run_tools_on_the_default_model(tmp_path):
    """``stagedserve serve`` with no model (SmolLM2-135M-Instruct, whose template does not show
    tools) and the flags auto tool choice needs; the libraries run to the end."""
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    log = (tmp_path / "serve.log").open("w+")
    env = {"STAGEDSERVE_API_KEY": KEY, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    process, url = spawn_serve(None, log, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", env=env)
    try:
        assert wait_until(serving_or_exited(process, url), timeout=300, interval=0.5) and process.poll() is None
        from openai import OpenAI

        [model] = [m.id for m in OpenAI(base_url=f"{url}/v1", api_key=KEY).models.list().data]
        chat_model = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key=KEY, max_tokens=16, temperature=0,
                                max_retries=0, timeout=600)
        answer = chat_model.bind_tools([weather_tool()]).invoke(ASK)  # tool_choice auto
        assert isinstance(answer, AIMessage) and (answer.tool_calls or answer.content)
        for call in answer.tool_calls:
            assert call["name"] == "get_weather" and Forecast.model_validate(call["args"])

        provider = OpenAIProvider(base_url=f"{url}/v1", api_key=KEY)
        agent = Agent(OpenAIChatModel(model, provider=provider), output_type=Forecast,
                      model_settings={"max_tokens": 80, "temperature": 0, "timeout": 600})
        calls = []

        @agent.tool_plain
        def get_forecast(city: Literal["Paris", "Rome"], days: int) -> str:
            """The weather forecast for a city."""
            calls.append(Forecast(city=city, days=days))  # its arguments follow the schema
            return get_weather(city, days)

        result = agent.run_sync(ASK)  # its tool and its output tool, with tool_choice required
        assert isinstance(result.output, Forecast)  # validated by pydantic-ai against the output type
        # Whatever the model called its own tool with went back to it as that call's result.
        returned = [part.content for message in result.all_messages() for part in message.parts
                    if isinstance(part, ToolReturnPart) and part.tool_name == "get_forecast"]
        assert returned == [get_weather(c.city, c.days) for c in calls]
    finally:
        stop_serve(process)
    log.seek(0)
    assert log.read().count("the chat template does not show tools") == 1  # logged once
