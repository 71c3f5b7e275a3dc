"""The Responses API through real clients, unchanged: the openai client's ``responses.create``
(text and message input, instructions, function tools and a tool result sent back, a JSON
schema output) and its stream helper; the OpenAI Agents SDK with its Responses model and its
chat model, a function tool and an output type; pydantic-ai (on chat), whose structured output
is a call of its output tool with tool_choice required."""

from __future__ import annotations

import asyncio
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.clients.conftest import TOOLS_KEY as KEY
from tests.clients.conftest import TOOLS_MODEL as MODEL

ASK = "What is the weather in Paris for the next two days?"


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast for a city",
           "parameters": Forecast.model_json_schema(), "strict": True}


@pytest.fixture
def client(tools_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{tools_server}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_responses_create_with_text_and_with_messages(client):
    response = client.responses.create(model=MODEL, input="Hello", instructions="Be terse.", max_output_tokens=6,
                                       temperature=0)
    assert response.object == "response" and response.status == "incomplete"  # six tokens did not end it
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and isinstance(response.output_text, str) and response.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    same = client.responses.create(model=MODEL, input=[{"role": "system", "content": "Be terse."},
                                                        {"role": "user", "content": [{"type": "input_text",
                                                                                      "text": "Hello"}]}],
                                   max_output_tokens=6, temperature=0)
    assert same.output_text == response.output_text  # instructions are the system message


def test_responses_forced_function_call_and_its_output_sent_back(client):
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=200, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    Forecast.model_validate_json(call.arguments)
    second = client.responses.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    alone = client.responses.create(model=MODEL, input=ASK, max_output_tokens=1, temperature=0)
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > alone.usage.input_tokens + 20  # the call and its result reached the prompt


def test_responses_json_schema_output_parses(client):
    response = client.responses.parse(model=MODEL, input=ASK, text_format=Forecast, max_output_tokens=200,
                                      temperature=0)
    assert isinstance(response.output_parsed, Forecast)


def test_responses_stream_events_in_order_and_the_final_response(client):
    with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=200, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    Forecast.model_validate_json(final.output[0].arguments)


@pytest.mark.parametrize(("body", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "message", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
])
def test_what_the_responses_route_cannot_do_is_a_400_naming_it(tools_server, body, param):
    r = httpx.post(f"{tools_server}/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param), r.json()


# ---- the OpenAI Agents SDK ---------------------------------------------------------------------------

def end_of_turn(tiny_llama) -> str:
    """The id of ``<|im_end|>``: biased up, the random model ends its free turn at once (the forced
    call is not touched: its grammar allows the end only once the call is complete)."""
    from shared import Tokenizer

    return str(Tokenizer(tiny_llama).hf.convert_tokens_to_ids("<|im_end|>"))


def agents_model(tools_server, kind: str):
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    client = AsyncOpenAI(base_url=f"{tools_server}/v1", api_key=KEY, max_retries=0, timeout=120)
    model_class = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
    return model_class(model=MODEL, openai_client=client)


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_agents_sdk_runs_a_function_tool_then_answers(tools_server, tiny_llama, kind):
    from agents import Agent, ModelSettings, Runner, function_tool

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: int = Field(ge=1, le=7)) -> str:
        """The weather forecast for a city."""
        calls.append((city, days))
        return f"Sunny in {city} for {days} days"

    agent = Agent(name="weather", instructions="Answer with the forecast.", tools=[get_weather],
                  model=agents_model(tools_server, kind),
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0,
                                               extra_body={"logit_bias": {end_of_turn(tiny_llama): 100}}))
    result = asyncio.run(Runner.run(agent, ASK, max_turns=3))  # the SDK resets tool_choice after the call
    assert len(calls) == 1 and calls[0][0] in ("Paris", "Rome")
    assert isinstance(result.final_output, str)


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_agents_sdk_output_type_gives_the_pydantic_object(tools_server, kind):
    from agents import Agent, ModelSettings, Runner

    agent = Agent(name="forecaster", instructions="Give a forecast.", output_type=Forecast,
                  model=agents_model(tools_server, kind),
                  model_settings=ModelSettings(max_tokens=200, temperature=0))
    assert isinstance(asyncio.run(Runner.run(agent, ASK, max_turns=1)).final_output, Forecast)


def test_agents_sdk_streamed_run_with_an_output_type(tools_server):
    from agents import Agent, ModelSettings, Runner

    agent = Agent(name="forecaster", output_type=Forecast, model=agents_model(tools_server, "responses"),
                  model_settings=ModelSettings(max_tokens=200, temperature=0))

    async def run():
        result = Runner.run_streamed(agent, ASK, max_turns=1)
        kinds = [event.type async for event in result.stream_events()]
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    assert isinstance(final, Forecast) and "raw_response_event" in kinds


# ---- pydantic-ai -------------------------------------------------------------------------------------

def pydantic_ai_agent(tools_server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{tools_server}/v1", api_key=KEY))
    return Agent(model, output_type=Forecast, model_settings={"max_tokens": 200, "temperature": 0})


def test_pydantic_ai_structured_output_comes_through_its_output_tool(tools_server):
    result = pydantic_ai_agent(tools_server).run_sync(ASK)  # a final_result tool with tool_choice required
    assert isinstance(result.output, Forecast)

