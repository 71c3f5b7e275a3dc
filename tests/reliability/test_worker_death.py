"""kill -9 of one serving process in the middle of streams, on the real ``stagedserve serve`` process tree.

The victims: the engine-core process, one data-parallel rank, the worker of the pipeline's first stage, and one
Ray worker of a tensor-parallel split. Whatever dies, every client in flight ends cleanly within a timeout (a
stream with an error event, then ``[DONE]``; a whole response with an OpenAI error object, never a traceback),
``/health`` tells the truth (503 once no engine is left; 200 while the other data-parallel rank serves on),
``/metrics`` shows nothing running, waiting or held in the KV cache of a dead engine, the survivor holds no KV
once its requests are done, and stopping the server leaves no process of its tree behind.

``tests/stage5/test_engine_process.py`` and ``test_data_parallel.py`` hold the engine process's and a rank's
death to the same promises through the Python API and whole responses; ``test_engine_death.py`` the gauges.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import psutil
import pytest

from tests.reliability.engine_faults import EngineFaults
from tests.reliability.served import KEY, mode_params, start, stop_and_leave_nothing, tree
from tests.stage5.server_fixtures import auth, metric, serving_processes, wait_until

TIMEOUT_S = 60
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
LONG = {"prompt": "a long one", "max_tokens": 230, "ignore_eos": True, "temperature": 0}
VICTIMS = {  # the mode each victim is killed in
    "engine-core": "engine-process",
    "dp-rank": "dp2",
    "pp-stage": "pp2",
    "ray-worker": "ray-tp2",
}


def victim_pid(victim: str, root: psutil.Process) -> int:
    roles = serving_processes(root)
    if victim in ("engine-core", "dp-rank"):
        name = "ss-engine-1" if victim == "dp-rank" else "ss-engine-0"
        return next(p.pid for p in roles["engine_cores"] if p.name() == name)
    if victim == "pp-stage":
        return next(p.pid for p in roles["workers"] if p.name() == "ss-tp-0")
    return next(p.pid for p in tree(root) if "RayWorkerWrapper" in " ".join(p.cmdline()))


def gauges(text: str, **labels: str) -> dict[str, float | None]:
    return {name: metric(text, name, **labels) for name in GAUGES}


async def read_stream(client: httpx.AsyncClient, started: asyncio.Event, count: list) -> list:
    """A streamed completion's events (``[DONE]`` as a string); ``started`` once its first token came."""
    events = []
    async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if len(events) == 1:
                    count[0] += 1
                    if count[0] == 2:
                        started.set()
    return events


async def kill_mid_stream(url: str, pid: int) -> tuple[list, list]:
    """Two streams and two whole completions under way, then kill -9 ``pid``; each one's outcome."""
    async with httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=TIMEOUT_S) as client:
        started, count = asyncio.Event(), [0]
        streams = [asyncio.ensure_future(read_stream(client, started, count)) for _ in range(2)]
        wholes = [asyncio.ensure_future(client.post("/v1/completions", json=LONG)) for _ in range(2)]
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        while (metric((await client.get("/metrics")).text, "vllm:num_requests_running") or 0) < 4:
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        # Every client ends in time, or wait_for raises: a hang fails the test.
        done = await asyncio.wait_for(asyncio.gather(*streams, *wholes), TIMEOUT_S)
        return done[:2], done[2:]


def clean_stream_end(events: list) -> str:
    """``"error"`` or ``"finished"``; anything else (no ``[DONE]``, a cut-off stream) fails."""
    assert events and events[-1] == "[DONE]", events[-3:]
    errors = [e["error"] for e in events[:-1] if "error" in e]
    if errors:
        assert len(errors) == 1 and events[-2] == {"error": errors[0]}, events[-3:]
        assert errors[0]["message"] and errors[0]["code"] and "Traceback" not in errors[0]["message"], errors[0]
        return "error"
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    return "finished"


def clean_response(response: httpx.Response) -> str:
    if response.status_code == 200:
        assert response.json()["choices"][0]["finish_reason"] == "length"
        return "finished"
    assert response.status_code in (500, 503), response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] and "Traceback" not in error["message"], error
    return "error"


@pytest.mark.parametrize("victim", [pytest.param(v, id=v, marks=mode_params((m,))[0].marks)
                                    for v, m in VICTIMS.items()])
def test_kill_9_mid_stream_ends_every_client_cleanly_and_leaves_nothing(tiny_llama, tmp_path, victim):
    mode, env = VICTIMS[victim], {}
    if mode in ("engine-process", "dp2"):  # slower steps: the requests still run at the kill (a split is slow)
        faults = EngineFaults(tmp_path / "faults")
        faults.slow_steps(0.03)
        env = faults.env
    process, url = start(tiny_llama, tmp_path, mode, env=env)
    root = psutil.Process(process.pid)
    pids = [p.pid for p in tree(root)]
    try:
        streams, wholes = asyncio.run(kill_mid_stream(url, victim_pid(victim, root)))
        outcomes = [clean_stream_end(s) for s in streams] + [clean_response(r) for r in wholes]
        with httpx.Client(base_url=url, headers=auth(KEY), timeout=TIMEOUT_S) as client:
            text = client.get("/metrics").text
            if victim == "dp-rank":  # its requests fail; the other rank's finish, and it serves on
                assert "error" in outcomes and "finished" in outcomes, outcomes
                assert client.get("/health").status_code == 200
                again = client.post("/v1/completions", json={**LONG, "max_tokens": 4})
                assert again.status_code == 200, again.text
                assert gauges(client.get("/metrics").text, engine="1") == dict.fromkeys(GAUGES, 0.0)
                assert gauges(client.get("/metrics").text, engine="0") == dict.fromkeys(GAUGES, 0.0)  # no KV held
            else:
                assert outcomes == ["error"] * 4, outcomes
                assert wait_until(lambda: client.get("/health").status_code == 503, timeout=30)
                assert client.get("/health").json()["error"]["code"] == "engine_unavailable"
                assert gauges(client.get("/metrics").text) == dict.fromkeys(GAUGES, 0.0), text
                refused = client.post("/v1/completions", json={**LONG, "max_tokens": 4})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        pids = list({*pids, *(p.pid for p in tree(root))})
    finally:
        left = stop_and_leave_nothing(process, pids)
    assert left == [], f"left running after the server stopped: {left}"
