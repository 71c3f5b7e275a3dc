"""Real clients, unchanged, doing structured output and tool calling: the openai client's
``chat.completions.parse``, tools and streamed tool calls; langchain-openai's
``with_structured_output`` (json_schema, function_calling, json_mode) and ``bind_tools``, and a
tool round trip; litellm with tools. On a random tiny Llama: the grammar makes every answer
valid, and the schemas are bounded (enums, ranged integers) so that every answer ends."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from shared import Tokenizer
from tests.clients.conftest import TOOLS_KEY as KEY
from tests.clients.conftest import TOOLS_MODEL as MODEL

ASK = "What is the weather in Paris for the next two days?"


class Forecast(BaseModel):
    """The weather forecast for a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def get_weather(city: Literal["Paris", "Rome"], days: int) -> str:
    """The weather forecast for a city."""
    return f"Sunny in {city} for {days} days"


def weather_tool():
    """``get_weather`` as a langchain tool whose schema bounds ``days`` (so a random model's call ends)."""
    from langchain_core.tools import StructuredTool

    return StructuredTool.from_function(get_weather, name="get_weather", args_schema=Forecast)


@pytest.fixture
def openai_client(tools_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{tools_server}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def chat_model(tools_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{tools_server}/v1", api_key=KEY, max_tokens=200, temperature=0,
                      max_retries=0)


# ---- openai ----------------------------------------------------------------------------------------

def test_openai_parse_returns_the_pydantic_object(openai_client):
    completion = openai_client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                      response_format=Verdict, max_tokens=200, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Verdict)
    assert Verdict.model_validate_json(completion.choices[0].message.content) == parsed


def test_openai_parse_with_a_strict_function_tool_gives_parsed_arguments(openai_client):
    import openai

    completion = openai_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice={"type": "function", "function": {"name": "Forecast"}}, max_tokens=200, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)


def test_openai_required_tool_call_and_its_result_in_the_next_turn(openai_client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": Forecast.model_json_schema()}}]
    messages = [{"role": "user", "content": ASK}]
    first = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                                  parallel_tool_calls=False,
                                                  max_tokens=300, temperature=0)
    [call] = first.choices[0].message.tool_calls
    arguments = Forecast.model_validate_json(call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": get_weather(arguments.city, arguments.days)}]
    second = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                                   max_tokens=4, temperature=0)
    alone = openai_client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_openai_streamed_tool_call_helper_assembles_the_call(openai_client):
    import openai

    with openai_client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[openai.pydantic_function_tool(Forecast)],
            tool_choice={"type": "function", "function": {"name": "Forecast"}}, max_tokens=200,
            temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    [call] = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)
    assert final.choices[0].finish_reason == "tool_calls"


# ---- langchain-openai ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_pydantic_object(chat_model, method):
    structured = chat_model.with_structured_output(Forecast, method=method)
    assert isinstance(structured.invoke(ASK), Forecast)


def test_langchain_with_structured_output_json_mode_parses_the_json(tools_server, tiny_llama):
    from langchain_openai import ChatOpenAI

    # json_mode asks for any JSON object; a bias towards "}" makes the random model close it at once.
    close = Tokenizer(tiny_llama).hf.encode("}", add_special_tokens=False)[0]
    model = ChatOpenAI(model=MODEL, base_url=f"{tools_server}/v1", api_key=KEY, max_tokens=50, temperature=0,
                       max_retries=0, logit_bias={close: 100})
    structured = model.with_structured_output({"title": "anything", "type": "object"}, method="json_mode")
    assert structured.invoke(ASK + " Answer in JSON.") == {}


def test_langchain_bind_tools_forced_and_auto(chat_model):
    from langchain_core.messages import AIMessage

    forced = chat_model.bind_tools([weather_tool()], tool_choice="get_weather").invoke(ASK)
    [call] = forced.tool_calls
    assert call["name"] == "get_weather" and Forecast.model_validate(call["args"])
    auto = chat_model.bind_tools([weather_tool()]).invoke(ASK)  # tool_choice auto: the model chose
    assert isinstance(auto, AIMessage) and all(c["name"] == "get_weather" for c in auto.tool_calls)


def test_langchain_tool_round_trip_runs_the_tool_and_sends_its_result(chat_model):
    from langchain_core.messages import HumanMessage

    weather = weather_tool()
    question = HumanMessage(ASK)
    call_message = chat_model.bind_tools([weather], tool_choice="get_weather").invoke([question])
    results = [weather.invoke(call) for call in call_message.tool_calls]  # ToolMessages
    assert results and results[0].content.startswith("Sunny in ")
    answer = chat_model.bind_tools([weather]).invoke([question, call_message, *results])
    assert answer.usage_metadata["input_tokens"] > call_message.usage_metadata["input_tokens"]


# ---- litellm -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_litellm_forced_tool_call(tools_server, stream):
    import litellm

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": Forecast.model_json_schema()}}]
    kwargs = dict(model=f"hosted_vllm/{MODEL}", api_base=f"{tools_server}/v1", api_key=KEY,
                  messages=[{"role": "user", "content": ASK}], tools=tools, max_tokens=200, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        chunks = list(litellm.completion(**kwargs, stream=True))
        message = litellm.stream_chunk_builder(chunks).choices[0].message
    else:
        message = litellm.completion(**kwargs).choices[0].message
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    Forecast.model_validate(json.loads(call.function.arguments))
