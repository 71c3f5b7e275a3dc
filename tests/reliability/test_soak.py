"""A bounded soak on loopback: many concurrent streaming clients that finish, disconnect or give up.

For ``SOAK_SECONDS`` (20 in the normal suite; ``make soak`` runs 300), ``SOAK_CLIENTS``
clients (32) loop against one live server whose KV pool is small enough that requests
queue and get preempted. Each request draws a prompt and an output length; then the client
either reads the whole stream, reads a whole non-streaming answer, closes the stream after
a few chunks (a disconnect mid-decode), or gives up before the first byte (a disconnect
in the queue or during prefill).

Afterwards: the server is healthy and idle (KV usage 0, nothing running or waiting), the
server's finished-request counters account for every request that reached it, no
``Request`` object is left alive, resident memory grew by less than a bound after
warm-up, and every completed output equals the offline engine's greedy output for the
same prompt and length.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time
from collections import Counter

import httpx
import pytest

from shared import SamplingParams
from shared.request import Request
from stage5_server.engine import make_async_llm
from stage5_server.server import create_app
from tests.invariants.prompts import PROMPTS as INVARIANT_PROMPTS
from tests.reliability.figures import count
from tests.stage5.server_fixtures import ENGINE_KWARGS, auth, make_llm, metric, running_server, wait_until

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "20"))
SOAK_CLIENTS = int(os.environ.get("SOAK_CLIENTS", "32"))
KEY = "soak-key"
MODEL = "tiny"
PROMPTS = [
    *INVARIANT_PROMPTS,
    "The quick brown fox jumps over the lazy dog. " * 3,
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Once upon a time",
]
LENGTHS = [1, 3, 8, 24, 64]
# 24 blocks of 16 tokens: far fewer than 32 clients want, so requests wait and get preempted.
ENGINE = dict(num_kv_blocks=24, max_num_seqs=16, max_num_batched_tokens=128)
RSS_GROWTH_LIMIT = 96 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def references(tiny_llama) -> dict[tuple[int, int], str]:
    """Greedy text of every (prompt, length) from the offline engine, one batch, nothing else running."""
    llm = make_llm(tiny_llama)
    pairs = [(p, n) for p in range(len(PROMPTS)) for n in LENGTHS]
    outputs = llm.generate([PROMPTS[p] for p, _ in pairs],
                           [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in pairs],
                           use_tqdm=False)
    return {pair: out.outputs[0].text for pair, out in zip(pairs, outputs)}


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Counter, mismatches: list) -> None:
    p, n = rng.randrange(len(PROMPTS)), rng.choice(LENGTHS)
    behaviour = rng.choices(["stream", "whole", "disconnect", "give_up"], weights=[55, 15, 20, 10])[0]
    body = {"model": MODEL, "prompt": PROMPTS[p], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": behaviour != "whole"}
    tally["sent"] += 1
    if behaviour == "give_up":  # before the first byte: in the queue or during prefill
        task = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(rng.uniform(0, 0.05))
        task.cancel()
        try:
            await task
            tally["give_up_too_late"] += 1  # it finished first: a normal completion
        except asyncio.CancelledError:
            tally["gave_up"] += 1
        return
    if behaviour == "whole":
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        tally["completed"] += 1
        if text != REFERENCES[(p, n)]:
            mismatches.append((p, n, text))
        return
    leave_after = rng.randint(1, 4) if behaviour == "disconnect" else None
    text, chunks, done = "", 0, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            chunks += 1
            tally["chunks"] += 1
            if leave_after is not None and chunks >= leave_after:
                break  # closing the stream here drops the connection mid-decode
    if done:
        tally["completed"] += 1
        if text != REFERENCES[(p, n)]:
            mismatches.append((p, n, text))
    else:
        tally["disconnected"] += 1


REFERENCES: dict[tuple[int, int], str] = {}


async def soak(url: str, seconds: float, clients: int, tally: Counter, mismatches: list,
               on_warm: callable) -> None:
    deadline = time.monotonic() + seconds
    warm_at = time.monotonic() + min(5.0, seconds / 3)
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=120, limits=limits) as client:
        async def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                await one_request(client, rng, tally, mismatches)
                if on_warm is not None and time.monotonic() >= warm_at:
                    on_warm()

        await asyncio.gather(*[client_loop(i) for i in range(clients)])


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_soak_many_streaming_clients_lose_nothing_and_leave_nothing_behind(tiny_llama, references, engine_process):
    REFERENCES.update(references)
    if engine_process:  # the engine core in a child process; this process keeps HTTP and (de)tokenization
        engine = make_async_llm(str(tiny_llama), engine_process=True, log_stats_interval=None,
                                **{**ENGINE_KWARGS, **ENGINE})
    else:
        engine = make_llm(tiny_llama, **ENGINE)
    app = create_app(engine, api_keys={KEY: "soak"}, served_model_name=MODEL, log_stats_interval=None)
    section = "soak_engine_process" if engine_process else "soak"
    tally, mismatches, rss = Counter(), [], {}

    def on_warm():
        if "warm" not in rss:
            gc.collect()
            rss["warm"] = rss_bytes()

    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is Request}  # a failed earlier test may hold some
    with running_server(app) as server:
        started = time.monotonic()
        asyncio.run(soak(server.url, SOAK_SECONDS, SOAK_CLIENTS, tally, mismatches, on_warm))
        elapsed = time.monotonic() - started

        def idle() -> bool:
            text = httpx.get(f"{server.url}/metrics", headers=auth(KEY), timeout=10).text
            return (metric(text, "vllm:kv_cache_usage_perc") == 0 and metric(text, "vllm:num_requests_running") == 0
                    and metric(text, "vllm:num_requests_waiting") == 0)

        assert wait_until(idle, timeout=30), "KV blocks or requests left behind"
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        text = httpx.get(f"{server.url}/metrics", headers=auth(KEY), timeout=10).text
        finished = {reason: metric(text, "vllm:request_success_total", finished_reason=reason) or 0
                    for reason in ("length", "stop", "abort", "error")}
        preemptions = metric(text, "vllm:num_preemptions_total") or 0
        last = httpx.post(f"{server.url}/v1/completions", headers=auth(KEY), timeout=60,
                          json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                "ignore_eos": True})
        assert last.status_code == 200 and last.json()["choices"][0]["text"] == REFERENCES[(0, 8)]

    if engine_process:
        engine.shutdown()
    gc.collect()
    leftover = [o for o in gc.get_objects() if type(o) is Request and id(o) not in before]
    growth = rss_bytes() - rss.get("warm", rss_bytes())
    for name in ("sent", "completed", "disconnected", "gave_up", "give_up_too_late", "chunks"):
        count(section, name, tally[name])
    count(section, "clients", SOAK_CLIENTS)
    count(section, "seconds", round(elapsed))
    count(section, "server_preemptions", int(preemptions))
    count(section, "server_aborts", int(finished["abort"]))
    count(section, "rss_growth_after_warmup_mib", round(growth / 2**20))

    assert not mismatches, f"{len(mismatches)} completed outputs differ from offline greedy: {mismatches[:3]}"
    assert tally["completed"] > SOAK_CLIENTS and tally["disconnected"] > 0 and tally["gave_up"] > 0, tally
    assert finished["error"] == 0 and finished["stop"] == 0  # ignore_eos: every finish is by length
    # Every request that reached the engine is counted once: as finished by length, or aborted.
    reached_for_sure = tally["completed"] + tally["disconnected"] + tally["give_up_too_late"] + 1  # +1: the last
    assert reached_for_sure <= finished["length"] + finished["abort"] <= tally["sent"] + 1
    assert finished["length"] >= tally["completed"] + 1
    assert finished["abort"] >= tally["disconnected"] - (finished["length"] - tally["completed"] - 1)
    assert not leftover, f"{len(leftover)} Request objects still alive"
    assert growth < RSS_GROWTH_LIMIT, f"resident memory grew by {growth / 2**20:.1f} MiB after warm-up"
