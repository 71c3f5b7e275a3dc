"""The disaggregation proxy in front of two real ``stagedserve serve`` processes, one of which stops answering:
``SIGSTOP`` freezes it (the kernel still accepts connections for it, so only a read deadline notices). A frozen
prefill instance is a 504 naming it within the proxy's deadline, never a wait without end; a frozen decode
instance is a 504 too; ``/health`` answers at once and names the frozen side; once the process goes on
(``SIGCONT``), so does the proxy.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from stage5_server.kv_transfer.proxy import create_proxy_app
from tests.stage5.server_fixtures import running_server, serving_or_exited, spawn_serve, stop_serve, wait_until

DEADLINE_S = 3.0
BODY = {"prompt": "Deadlines on both sides of the proxy", "max_tokens": 4, "temperature": 0}
pytestmark = pytest.mark.slow  # two servers start: about half a minute


@pytest.fixture(scope="module")
def instances(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("proxy-deadlines")
    flags = ("--max-model-len", "128", "--num-kv-blocks", "32", "--log-stats-interval", "0", "--no-engine-process")
    spawned = {name: spawn_serve(tiny_llama, (logs / f"{name}.log").open("w"), *flags, env={"OMP_NUM_THREADS": "1"})
               for name in ("prefill", "decode")}
    try:
        for process, url in spawned.values():
            assert wait_until(serving_or_exited(process, url), timeout=180) and process.poll() is None
        app = create_proxy_app(spawned["prefill"][1], spawned["decode"][1], prefill_timeout_s=DEADLINE_S,
                               decode_timeout_s=DEADLINE_S)
        with running_server(app) as proxy:
            yield {name: process for name, (process, _) in spawned.items()}, proxy.url
    finally:
        for process, _ in spawned.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                stop_serve(process)


def frozen(process):
    class Frozen:
        def __enter__(self):
            os.kill(process.pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            os.kill(process.pid, signal.SIGCONT)

    return Frozen()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_frozen_instance_is_a_504_within_the_deadline_and_health_names_it(instances, side):
    processes, url = instances
    assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200
    with frozen(processes[side]):
        started = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        waited = time.monotonic() - started
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert f"the {side} instance" in error["message"] and f"{DEADLINE_S:g} s" in error["message"], error
        assert DEADLINE_S - 0.5 < waited < DEADLINE_S + 10
        started = time.monotonic()
        health = httpx.get(f"{url}/health", timeout=60)
        assert time.monotonic() - started < 5
        assert health.status_code == 503 and health.json()[side] == "not answering", health.text
    assert wait_until(lambda: httpx.get(f"{url}/health", timeout=60).status_code == 200, timeout=30)
    assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200


def test_a_stream_whose_decode_instance_goes_silent_ends_with_an_error_event(instances):
    processes, url = instances
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "max_tokens": 110, "stream": True,
                                                             "ignore_eos": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        with frozen(processes["decode"]):
            rest = [line for line in lines if line]
    assert "sent nothing for" in rest[-1] and '"code": 504' in rest[-1], rest[-3:]
