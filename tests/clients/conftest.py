"""Servers for the client tests that need tools and structured output: a context long enough
for tool definitions in the tiny tokenizer, auto tool choice with the Hermes parser; one on the
tiny Llama's own template (which shows tools), one on a copy whose template does not."""

from __future__ import annotations

import shutil

import pytest

from stage5_server.server import create_app
from stage5_server.server.chat_options import ChatOptions
from tests.stage5.server_fixtures import make_llm, running_server

TOOLS_KEY = "test-key-client-tools"
TOOLS_MODEL = "tiny-llama-tools"
# ChatML that knows nothing of tools, as many models' templates (the default model's among them).
PLAIN_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tools_app(checkpoint):
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    llm = make_llm(checkpoint, max_model_len=2048, num_kv_blocks=512, max_num_batched_tokens=2048)
    return create_app(llm, api_keys=[TOOLS_KEY], served_model_name=TOOLS_MODEL, log_stats_interval=None,
                      chat_options=options)


@pytest.fixture(scope="module")
def tools_server(tiny_llama):
    with running_server(tools_app(tiny_llama)) as running:
        yield running.url


@pytest.fixture(scope="module")
def plain_chatml_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny Llama with a chat template that cannot show tools."""
    checkpoint = tmp_path_factory.mktemp("plain-chatml") / "tiny-llama"
    shutil.copytree(tiny_llama, checkpoint)
    (checkpoint / "chat_template.jinja").write_text(PLAIN_CHATML)
    return checkpoint


@pytest.fixture(scope="module")
def plain_chatml_server(plain_chatml_checkpoint):
    with running_server(tools_app(plain_chatml_checkpoint)) as running:
        yield running.url
