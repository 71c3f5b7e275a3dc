"""``AsyncLLM`` without HTTP: one engine thread owns the LLM; streams, aborts, failures, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from shared import SamplingParams
from stage5_server.engine import AsyncLLM, EngineDeadError, EngineError, RequestAborted
from tests.stage5.server_fixtures import EngineCallRecorder, fail_execute, make_llm, wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=10)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture
def engine(llm):
    engine = AsyncLLM.from_llm(llm, log_stats_interval=None)
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, prompt: str, params: SamplingParams = GREEDY):
    return [out async for out in engine.generate(prompt, params)]


def test_generate_streams_cumulative_outputs_that_end_like_offline_generate(llm):
    reference = llm.generate(["Hello there"], GREEDY, use_tqdm=False)[0].outputs[0]
    engine = AsyncLLM.from_llm(llm, log_stats_interval=None)
    try:
        outputs = asyncio.run(collect(engine, "Hello there"))
    finally:
        engine.shutdown()
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    texts = [o.outputs[0].text for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert (texts[-1], outputs[-1].outputs[0].token_ids) == (reference.text, reference.token_ids)


def test_every_llm_call_happens_on_the_engine_thread(llm):
    recorder = EngineCallRecorder(llm)
    engine = AsyncLLM.from_llm(llm, log_stats_interval=None)
    try:
        async def run():
            await asyncio.gather(*[collect(engine, f"prompt {i}") for i in range(4)])
            stream = await engine.add_request("to abort", LONG)
            await stream.get()
            engine.abort(stream.request_id)

        asyncio.run(run())
        assert wait_until(lambda: engine.stats.num_running == 0)
    finally:
        engine.shutdown()
        recorder.restore()
    assert recorder.threads == {"stagedserve-engine"}


def test_abort_ends_the_stream_and_frees_the_kv_blocks(engine):
    async def run():
        stream = await engine.add_request("a long one", LONG)
        await stream.get()
        engine.abort(stream.request_id)
        with pytest.raises(RequestAborted):
            while True:
                await stream.get()

    asyncio.run(run())
    assert wait_until(lambda: engine.stats.kv_cache_usage == 0 and engine.stats.num_running == 0)


def test_closing_generate_early_aborts_the_request(engine):
    async def run():
        generator = engine.generate("another long one", LONG)
        async for _ in generator:
            break
        await generator.aclose()

    asyncio.run(run())
    assert wait_until(lambda: engine.stats.kv_cache_usage == 0 and engine.stats.num_running == 0)


def test_invalid_input_raises_value_error_naming_the_field(engine):
    async def run(prompt):
        await engine.add_request(prompt, GREEDY)

    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(run(""))
    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(run("word " * 400))


def test_a_failed_step_fails_every_request_in_flight_and_the_loop_keeps_serving(engine, llm, monkeypatch):
    fail_execute(monkeypatch, llm, times=1, min_requests=3)  # a step with all three in it, however they arrive

    async def run():
        results = await asyncio.gather(*[collect(engine, f"doomed {i}", LONG) for i in range(3)],
                                       return_exceptions=True)
        assert all(isinstance(r, EngineError) for r in results), results
        return await collect(engine, "after the failure")

    outputs = asyncio.run(run())
    assert outputs[-1].finished
    assert wait_until(lambda: engine.stats.kv_cache_usage == 0)


def test_shutdown_fails_requests_in_flight_and_refuses_new_ones(llm):
    engine = AsyncLLM.from_llm(llm, log_stats_interval=None)

    async def run():
        stream = await engine.add_request("in flight at shutdown", LONG)
        await stream.get()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            while True:
                await stream.get()
        with pytest.raises(EngineDeadError):
            await engine.add_request("too late", GREEDY)

    asyncio.run(run())
    assert not engine.is_running
    assert llm.engine.kv_cache_usage() == 0


def test_the_stats_line_is_logged_periodically(llm, caplog):
    engine = AsyncLLM.from_llm(llm, log_stats_interval=0.05, idle_poll_s=0.01)
    try:
        with caplog.at_level("INFO", logger="stagedserve"):
            asyncio.run(collect(engine, "log me", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
            assert wait_until(lambda: any("Avg prompt throughput" in r.getMessage() for r in caplog.records))
    finally:
        engine.shutdown()
    line = next(r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage())
    for field in ("Avg generation throughput", "Running:", "Waiting:", "KV cache usage:",
                  "Prefix cache hit rate:", "Preemptions:"):
        assert field in line
