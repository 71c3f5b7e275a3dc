"""A server for the client tests that need tools and structured output: a context long enough
for tool definitions in the tiny tokenizer, auto tool choice with the Hermes parser."""

from __future__ import annotations

import pytest

from stage5_server.server import create_app
from stage5_server.server.chat_options import ChatOptions
from tests.stage5.server_fixtures import make_llm, running_server

TOOLS_KEY = "test-key-client-tools"
TOOLS_MODEL = "tiny-llama-tools"


@pytest.fixture(scope="module")
def tools_server(tiny_llama):
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    llm = make_llm(tiny_llama, max_model_len=2048, num_kv_blocks=512, max_num_batched_tokens=2048)
    app = create_app(llm, api_keys=[TOOLS_KEY], served_model_name=TOOLS_MODEL, log_stats_interval=None,
                     chat_options=options)
    with running_server(app) as running:
        yield running.url
