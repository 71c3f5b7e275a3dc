"""Injected faults over HTTP: each fails only the requests it must, with a clear error, and the server goes on.

- an exception inside a model step: the requests in that step fail (500, or an error event
  mid-stream); requests still waiting for their turn were never in it and finish normally;
- a tokenizer failure: the request that hit it fails with an OpenAI error object, nothing
  else notices;
- a client that disconnects while its long prompt is still being prefilled: the request is
  aborted and its KV returns;
- a preemption storm on a pool barely larger than one sequence: every request still
  finishes, with exactly the offline greedy output.

Each runs in every engine mode (``modes.py``): the engine core in-process, in its own process
(the server's default), and as two data-parallel ranks. Faults reach the engine cores through
``engine_faults.py`` wherever they run; the tokenizer is the API server's in every mode.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from shared import SamplingParams
from stage5_server.server import create_app
from tests.reliability.engine_faults import EngineFaults
from tests.reliability.figures import count
from tests.reliability.modes import make_engine, mode_params, num_ranks, shutdown
from tests.stage5.server_fixtures import auth, make_llm, metric, running_server, wait_until

KEY = "faults-key"
MODEL = "tiny"
PROMPTS = [f"Request number {i} asks for a long answer about paged attention" for i in range(8)]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text and KEY not in response.text
    return body["error"]


def idle(url: str) -> bool:
    text = httpx.get(f"{url}/metrics", headers=auth(KEY), timeout=10).text
    return (metric(text, "vllm:kv_cache_usage_perc") == 0 and metric(text, "vllm:num_requests_running") == 0
            and metric(text, "vllm:num_requests_waiting") == 0)


def aborted_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=auth(KEY), timeout=10).text
    return metric(text, "vllm:request_success_total", finished_reason="abort") or 0


def greedy(llm, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


async def complete_all(url: str, prompts: list[str], max_tokens: int, stagger: float = 0.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=120) as client:
        async def one(i: int, prompt: str) -> httpx.Response:
            await asyncio.sleep(i * stagger)
            return await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0,
                                                              "max_tokens": max_tokens, "ignore_eos": True})

        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])


@pytest.fixture(scope="module", params=mode_params("faults"))
def one_at_a_time(request, tiny_llama, tmp_path_factory):
    """A server whose engine cores run one request at a time (the others wait their turn in the queue) and
    prefill 16 prompt tokens a step, with faults the test can inject into them."""
    faults = EngineFaults(tmp_path_factory.mktemp("faults"))
    expected = greedy(make_llm(tiny_llama), PROMPTS[:4], 6)
    engine = make_engine(request.param, tiny_llama, faults, max_num_seqs=1, max_num_batched_tokens=16)
    app = create_app(engine, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    try:
        with running_server(app) as server:
            yield app.state.engine, server.url, expected, faults
    finally:
        shutdown(engine)
        faults.slow_steps(0)


def test_a_failed_model_step_fails_the_requests_in_it_and_not_the_ones_waiting(one_at_a_time):
    engine, url, expected, faults = one_at_a_time
    faults.slow_steps(0.05)  # keep the long request running (~5 s) while the short ones queue
    ranks = len(engine.stats_by_engine)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=120) as client:
            def post(prompt: str, max_tokens: int):
                return asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                    "ignore_eos": True}))

            running = post("the long one, running when the step fails", 100)
            await until(client, running=1, waiting=0)
            if ranks == 2:  # hold the idle rank's first step until all four requests are routed
                idle_rank = min(engine.in_flight_by_engine, key=engine.in_flight_by_engine.get)
                faults.hold_steps(engine.engine_pids[idle_rank])
            waiting = [post(p, 6) for p in PROMPTS[1:4]]
            if ranks == 2:
                # Then two steps: the first publishes its short request running, the second the one it took in
                # meanwhile waiting; held again, it cannot finish one (~0.3 s) between two polls of /metrics.
                await until_routed(engine, 4)
                faults.hold_steps(engine.engine_pids[idle_rank], after=2)
            # One rank: 1 running, 3 waiting. Two: rank 1 runs one short request, each rank queues one.
            await until(client, running=ranks, waiting=4 - ranks)
            faults.fail_next_step()  # claimed by the long request's step: the only core not held
            failed = await running
            faults.release_steps()
            return failed, await asyncio.gather(*waiting)

    try:
        failed, others = asyncio.run(scenario())
    finally:
        faults.release_steps()
        faults.slow_steps(0)
    responses = [failed, *others]
    errors = [error_of(r, 500) for r in responses if r.status_code != 200]
    assert len(errors) == 1 and errors[0]["code"] == "engine_error" and "failed" in errors[0]["message"]
    assert failed.status_code == 500  # the failed step held only the running request
    for prompt, response in zip(PROMPTS[1:4], others):
        if response.status_code == 200:
            assert response.json()["choices"][0]["text"] == expected[PROMPTS.index(prompt)]
    assert faults.failed_steps() >= 1
    assert wait_until(lambda: idle(url))
    count("faults", "model_step_exceptions")
    count("faults", "requests_failed_by_them", 1)
    count("faults", "requests_that_went_on", 3)


async def until(client: httpx.AsyncClient, running: int, waiting: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        if (metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")) == (running,
                                                                                                      waiting):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the engine never had {running} running and {waiting} waiting")


async def until_routed(engine, num_requests: int, timeout: float = 30) -> None:
    """Until the API server has sent ``num_requests`` requests in flight to the engine cores (data parallel)."""
    deadline = time.monotonic() + timeout
    while sum(engine.in_flight_by_engine.values()) != num_requests:
        if time.monotonic() > deadline:
            raise AssertionError(f"the API server never had {num_requests} requests in flight")
        await asyncio.sleep(0.005)


class PanicException(BaseException):
    """What a Rust panic inside the tokenizer raises through pyo3: a BaseException, not an Exception."""


@pytest.mark.parametrize("failure", [RuntimeError, PanicException])
def test_a_tokenizer_failure_on_the_prompt_fails_that_request_only(one_at_a_time, monkeypatch, failure):
    engine, url, _, _ = one_at_a_time
    encode = engine.tokenizer.encode  # the API server's, in every mode

    def flaky_encode(text, *args, **kwargs):
        if "poison" in text:
            raise failure("injected tokenizer failure")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", flaky_encode)
    body = {"model": MODEL, "prompt": "poison pill", "max_tokens": 2}
    for route, payload in (("/v1/completions", body), ("/tokenize", {"prompt": "poison pill"})):
        error = error_of(httpx.post(f"{url}{route}", json=payload, headers=auth(KEY), timeout=30), 500)
        assert "injected" not in error["message"]  # internal details stay in the log
        count("faults", "tokenizer_failures")
    ok = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "a healthy prompt"}, headers=auth(KEY),
                    timeout=30)
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert wait_until(lambda: idle(url))


def test_a_tokenizer_panic_while_detokenizing_a_step_fails_requests_not_the_server(one_at_a_time, monkeypatch):
    engine, url, expected, _ = one_at_a_time
    decode = engine.tokenizer.decode
    panicked = threading.Event()

    def panicking_decode(*args, **kwargs):
        if not panicked.is_set():
            panicked.set()
            raise PanicException("injected panic while detokenizing")
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "decode", panicking_decode)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    error = error_of(httpx.post(f"{url}/v1/completions", json=body, headers=auth(KEY), timeout=30), 500)
    assert error["code"] == "engine_error"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    again = httpx.post(f"{url}/v1/completions", json=body, headers=auth(KEY), timeout=30)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected[1]
    assert wait_until(lambda: idle(url))
    count("faults", "tokenizer_failures")


def test_a_client_that_disconnects_during_prefill_is_aborted_and_its_kv_returns(one_at_a_time):
    # 16 prompt tokens a step and a slowed forward pass: a 200-token prompt takes a while to prefill.
    _, url, _, faults = one_at_a_time
    long_prompt = list(range(10, 210))  # token ids: exactly 200 prompt tokens
    before_aborts, before_tokens = aborted_count(url), generated_tokens(url)
    faults.slow_steps(0.03)
    try:
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", headers=auth(KEY),
                           json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4, "stream": stream},
                           timeout=httpx.Timeout(30, read=0.15))
            count("faults", "disconnects_during_prefill")
    finally:
        faults.slow_steps(0)
    assert wait_until(lambda: idle(url))
    assert aborted_count(url) == before_aborts + 2
    assert generated_tokens(url) == before_tokens  # neither reached its first token
    ok = httpx.post(f"{url}/v1/completions", headers=auth(KEY), timeout=60,
                    json={"model": MODEL, "prompt": "after the disconnects", "max_tokens": 2})
    assert ok.status_code == 200


def generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=auth(KEY), timeout=10).text
    return metric(text, "vllm:generation_tokens_total") or 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", mode_params("storm"))
def test_a_preemption_storm_finishes_every_request_with_the_greedy_output(tiny_llama, mode):
    # 16 blocks of 16 tokens = one max_model_len sequence; 8 requests of ~12 + 120 tokens each want 4x that
    # (per rank: with two ranks, each gets about half the requests and has its own 16 blocks).
    expected = greedy(make_llm(tiny_llama), PROMPTS, 120)
    engine = make_engine(mode, tiny_llama, num_kv_blocks=16, max_num_seqs=8)
    app = create_app(engine, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    try:
        with running_server(app) as server:
            responses = asyncio.run(complete_all(server.url, PROMPTS, 120))
            assert [r.status_code for r in responses] == [200] * len(PROMPTS), [r.text for r in responses]
            assert [r.json()["choices"][0]["text"] for r in responses] == expected
            assert wait_until(lambda: idle(server.url))
            text = httpx.get(f"{server.url}/metrics", headers=auth(KEY), timeout=10).text
            preemptions = metric(text, "vllm:num_preemptions_total")
            assert preemptions >= len(PROMPTS) // num_ranks(mode), preemptions
    finally:
        shutdown(engine)
    count("faults", "preemption_storm_requests", len(PROMPTS))
    count("faults", "preemption_storm_preemptions", int(preemptions))
