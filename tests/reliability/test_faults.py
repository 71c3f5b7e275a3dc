"""Injected faults over HTTP: each fails only the requests it must, with a clear error, and the server goes on.

- an exception inside a model step: the requests in that step fail (500, or an error event
  mid-stream); requests still waiting for their turn were never in it and finish normally;
- a tokenizer failure: the request that hit it fails with an OpenAI error object, nothing
  else notices;
- a client that disconnects while its long prompt is still being prefilled: the request is
  aborted and its KV returns;
- a preemption storm on a pool barely larger than one sequence: every request still
  finishes, with exactly the offline greedy output.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from shared import SamplingParams
from stage5_server.server import create_app
from tests.reliability.figures import count
from tests.stage5.server_fixtures import auth, engine_runner, make_llm, metric, running_server, wait_until

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


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama):
    """A server that runs one request at a time: the others wait their turn in the queue."""
    llm = make_llm(tiny_llama, max_num_seqs=1)
    expected = greedy(llm, PROMPTS[:4], 6)  # before the engine thread owns the LLM
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        yield llm, server.url, expected


def test_a_failed_model_step_fails_the_requests_in_it_and_not_the_ones_waiting(one_at_a_time, monkeypatch):
    llm, url, expected = one_at_a_time
    runner = engine_runner(llm)
    execute = runner.execute
    fail_next = threading.Event()

    def execute_or_fail(*args, **kwargs):
        time.sleep(0.02)  # keep the long request running (~4 s) while the others queue behind it
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("injected model failure")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute_or_fail)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=120) as client:
            def post(prompt: str, max_tokens: int):
                return asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                    "ignore_eos": True}))

            running = post("the long one, running when the step fails", 200)
            await until(client, running=1, waiting=0)
            waiting = [post(p, 6) for p in PROMPTS[1:4]]
            await until(client, running=1, waiting=3)
            fail_next.set()
            return await running, await asyncio.gather(*waiting)

    failed, others = asyncio.run(scenario())
    error = error_of(failed, 500)
    assert error["code"] == "engine_error" and "failed" in error["message"]
    assert [r.status_code for r in others] == [200, 200, 200], [r.text for r in others]
    assert [r.json()["choices"][0]["text"] for r in others] == expected[1:]
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


class PanicException(BaseException):
    """What a Rust panic inside the tokenizer raises through pyo3: a BaseException, not an Exception."""


@pytest.mark.parametrize("failure", [RuntimeError, PanicException])
def test_a_tokenizer_failure_on_the_prompt_fails_that_request_only(one_at_a_time, monkeypatch, failure):
    llm, url, _ = one_at_a_time
    encode = llm.tokenizer.encode

    def flaky_encode(text, *args, **kwargs):
        if "poison" in text:
            raise failure("injected tokenizer failure")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", flaky_encode)
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
    llm, url, expected = one_at_a_time
    decode = llm.tokenizer.decode
    panicked = threading.Event()

    def panicking_decode(*args, **kwargs):
        if not panicked.is_set():
            panicked.set()
            raise PanicException("injected panic while detokenizing")
        return decode(*args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", panicking_decode)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    error = error_of(httpx.post(f"{url}/v1/completions", json=body, headers=auth(KEY), timeout=30), 500)
    assert error["code"] == "engine_error"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    again = httpx.post(f"{url}/v1/completions", json=body, headers=auth(KEY), timeout=30)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected[1]
    assert wait_until(lambda: idle(url))
    count("faults", "tokenizer_failures")


def test_a_client_that_disconnects_during_prefill_is_aborted_and_its_kv_returns(tiny_llama, monkeypatch):
    # 16 prompt tokens a step and a slowed forward pass: a ~200-token prompt takes a while to prefill.
    llm = make_llm(tiny_llama, max_num_batched_tokens=16)
    runner = engine_runner(llm)
    execute = runner.execute
    steps = {"prefill_chunks_seen": 0}

    def slow_execute(batch, *args, **kwargs):
        steps["prefill_chunks_seen"] += 1
        time.sleep(0.03)
        return execute(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    long_prompt = list(range(10, 210))  # token ids: exactly 200 prompt tokens
    with running_server(app) as server:
        before = aborted_count(server.url)
        for stream in (False, True):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/completions", headers=auth(KEY),
                           json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4, "stream": stream},
                           timeout=httpx.Timeout(30, read=0.15))
            count("faults", "disconnects_during_prefill")
        assert wait_until(lambda: idle(server.url))
        assert aborted_count(server.url) == before + 2
        text = httpx.get(f"{server.url}/metrics", headers=auth(KEY), timeout=10).text
        assert (metric(text, "vllm:generation_tokens_total") or 0) == 0  # neither reached its first token
        ok = httpx.post(f"{server.url}/v1/completions", headers=auth(KEY), timeout=60,
                        json={"model": MODEL, "prompt": "after the disconnects", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.slow
def test_a_preemption_storm_finishes_every_request_with_the_greedy_output(tiny_llama):
    # 16 blocks of 16 tokens = one max_model_len sequence; 8 requests of ~12 + 120 tokens each want 4x that.
    llm = make_llm(tiny_llama, num_kv_blocks=16, max_num_seqs=8)
    expected = greedy(llm, PROMPTS, 120)
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        responses = asyncio.run(complete_all(server.url, PROMPTS, 120))
        assert [r.status_code for r in responses] == [200] * len(PROMPTS), [r.text for r in responses]
        assert [r.json()["choices"][0]["text"] for r in responses] == expected
        text = httpx.get(f"{server.url}/metrics", headers=auth(KEY), timeout=10).text
        preemptions = metric(text, "vllm:num_preemptions_total")
        assert preemptions >= len(PROMPTS), preemptions
        assert wait_until(lambda: idle(server.url))
    count("faults", "preemption_storm_requests", len(PROMPTS))
    count("faults", "preemption_storm_preemptions", int(preemptions))
