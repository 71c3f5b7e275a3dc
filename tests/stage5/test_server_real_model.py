"""``stagedserve serve`` with no model starts on SmolLM2-135M-Instruct (the engine in its own process,
the KV cache sized from free memory) and, in float32, answers through the official ``openai`` client
with transformers' own tokens on the ``.gguf`` file; with no flags at all it starts on the default
model (bfloat16 where the CPU has bf16 units) and on every checkpoint the test suite builds; in bfloat16 it
answers while its compiled step compiles in the background, and after."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from openai import OpenAI

from shared import Tokenizer, default_model, tiny_chat_model
from stage5_server.cli import main
from tests.invariants.real_model import CHATS, MAX_TOKENS, smollm2_reference
from tests.shared.gguf_files import write_gguf
from tests.stage5.server_fixtures import serving_or_exited, spawn_serve, stop_serve, wait_until

KEY = "test-key-real-model"


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_serve_with_no_model_answers_with_transformers_tokens_on_the_default_model(tmp_path):
    reference = smollm2_reference()
    tokenizer = Tokenizer(default_model())
    log = (tmp_path / "serve.log").open("w+")
    # As many torch threads as this test process has (under xdist the cores are shared).
    env = {"STAGEDSERVE_API_KEY": KEY, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    process, url = spawn_serve(None, log, "--dtype", "float32", env=env)  # the dtype parity is stated in
    try:
        assert wait_until(serving_or_exited(process, url), timeout=300, interval=0.5) and process.poll() is None
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        [model] = [m.id for m in client.models.list().data]
        for chat, want in zip(CHATS, reference):
            response = client.chat.completions.create(model=model, messages=chat, max_tokens=MAX_TOKENS,
                                                      temperature=0.0)
            assert response.choices[0].message.content == tokenizer.decode(list(want.token_ids))
            assert response.usage.prompt_tokens == len(want.prompt_token_ids)
            assert response.usage.completion_tokens == len(want.token_ids)
        stream = client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=MAX_TOKENS,
                                                temperature=0.0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len([p for p in pieces if p]) > 1 and "".join(pieces) == "The capital of France is Paris."
    finally:
        stop_serve(process)
    log.seek(0)
    output = log.read()
    assert "engine arguments from the command line: {'dtype': 'float32'}" in output
    assert "max_model_len=8192" in output and "KV cache sized automatically" in output


@pytest.fixture
def fake_uvicorn_run(monkeypatch):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(app))
    return calls


def test_serve_with_no_engine_flags_starts_on_every_test_checkpoint(checkpoints, tmp_path, fake_uvicorn_run):
    models = {**checkpoints, "default": None, "tiny-chat": tiny_chat_model(),
              "gguf": write_gguf(checkpoints["llama"], tmp_path / "tiny-llama-Q8_0.gguf", "Q8_0")}
    for name, model in models.items():
        model_arg = [] if model is None else [str(model)]
        assert main(["serve", *model_arg, "--port", "0", "--no-engine-process", "--log-stats-interval", "0"]) == 0, name
        app = fake_uvicorn_run.pop()
        core = app.state.engine.core
        try:
            assert core.max_model_len == core.config.model_config.max_position_embeddings, name
            assert core.num_kv_blocks * core.config.cache.block_size >= core.max_model_len, name
        finally:
            app.state.engine.shutdown()


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_serve_on_the_default_model_in_bfloat16_answers_while_its_step_compiles_and_after(tmp_path):
    """A server compiles its compiled step in the background: it answers at once (eager steps), and once
    the graphs are in, the same chat runs on them, with no step left to compile and none run eagerly."""
    log = (tmp_path / "serve.log").open("w+")
    env = {"STAGEDSERVE_API_KEY": KEY, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    process, url = spawn_serve(None, log, "--dtype", "bfloat16", env=env)  # the CPU fast path on any CPU

    def said(text: str) -> Callable[[], bool]:
        return lambda: (log.seek(0), text in log.read())[1] or process.poll() is not None

    try:
        assert wait_until(serving_or_exited(process, url), timeout=300, interval=0.5) and process.poll() is None
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
        [model] = [m.id for m in client.models.list().data]

        def chat() -> str:
            response = client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=MAX_TOKENS,
                                                      temperature=0.0)
            return response.choices[0].message.content

        while_compiling = chat()
        assert wait_until(said("decode steps padded to"), timeout=1200, interval=1) and process.poll() is None
        compiled = chat()
        stream = client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=MAX_TOKENS,
                                                temperature=0.0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        stop_serve(process)
    log.seek(0)
    output = log.read()
    assert "compiling in the background" in output
    assert "Paris" in while_compiling and "Paris" in compiled and streamed == compiled
    assert "every step runs eagerly" not in output and "no graph fits" not in output
