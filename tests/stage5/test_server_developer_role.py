"""On the default model (SmolLM2, whose chat template names no developer role) a ``developer`` turn is the system
turn it stands for, on every route that renders a conversation: chat, ``/tokenize`` and the Responses API
(a developer input item, and ``instructions``), each counting the prompt tokens a system turn gives."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from shared import default_model
from stage5_server import LLM
from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, running_server

KEY = "test-key-developer-role"
MODEL = "smollm2"
INSTRUCTION, QUESTION = "Answer in one word.", "What is the capital of France?"


@pytest.fixture(scope="module")
def url():
    llm = LLM(default_model(), max_model_len=256, num_kv_blocks=64, block_size=16)
    with running_server(create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)) as server:
        yield server.url


def conversation(role: str) -> list[dict]:
    return [{"role": role, "content": INSTRUCTION}, {"role": "user", "content": QUESTION}]


@pytest.mark.slow
def test_a_developer_turn_costs_the_tokens_of_a_system_turn_on_chat_tokenize_and_responses(url):
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    with httpx.Client(base_url=url, headers=auth(KEY), timeout=120) as http:
        counts = {role: http.post("/tokenize", json={"messages": conversation(role)}).json()["count"]
                  for role in ("system", "developer")}
    assert counts["developer"] == counts["system"] == 26  # unmapped, the template's default system prompt: 48
    chat = {role: client.chat.completions.create(model=MODEL, messages=conversation(role), max_tokens=1,
                                                 temperature=0).usage.prompt_tokens for role in ("system", "developer")}
    assert chat == {"system": 26, "developer": 26}
    item = client.responses.create(model=MODEL, input=conversation("developer"), max_output_tokens=1)
    instructions = client.responses.create(model=MODEL, instructions=INSTRUCTION, input=QUESTION, max_output_tokens=1)
    assert item.usage.input_tokens == instructions.usage.input_tokens == 26
