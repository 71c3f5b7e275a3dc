"""What is left when an engine process dies, or when the API server above it is killed.

- ``/metrics`` of a server whose engine core died reports nothing running, waiting or held in the KV
  cache (its counters keep what it did), rather than the dead core's last step;
- an engine-core process whose API server is killed exits within a fraction of a second
  (``docs/serving.md``), idle or in the middle of a stream.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from stage5_server.engine import MPAsyncLLM
from stage5_server.server import create_app
from tests.stage5.server_fixtures import (
    ENGINE_KWARGS,
    auth,
    metric,
    running_server,
    serving_or_exited,
    spawn_serve,
    wait_until,
)

KEY = "death-key"
MODEL = "tiny"
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dead_engines_gauges_read_zero(tiny_llama):
    engine = MPAsyncLLM(str(tiny_llama), log_stats_interval=None, startup_timeout_s=120, **ENGINE_KWARGS)
    app = create_app(engine, api_keys=[KEY], served_model_name=MODEL)
    try:
        with running_server(app) as server, httpx.Client(base_url=server.url, headers=auth(KEY), timeout=60) as c:
            def gauges() -> dict[str, float | None]:
                text = c.get("/metrics").text
                return {name: metric(text, name) for name in GAUGES}

            body = {"model": MODEL, "prompt": "a long one", "max_tokens": 240, "ignore_eos": True}
            threading.Thread(target=lambda: c.post("/v1/completions", json=body), daemon=True).start()
            assert wait_until(lambda: gauges()["vllm:num_requests_running"] == 1, timeout=30)
            assert gauges()["vllm:kv_cache_usage_perc"] > 0
            os.kill(engine.engine_pid, signal.SIGKILL)
            assert wait_until(lambda: c.get("/health").status_code == 503, timeout=30)
            assert gauges() == dict.fromkeys(GAUGES, 0.0)
            assert metric(c.get("/metrics").text, "vllm:generation_tokens_total") > 0  # counters keep their count
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "streaming"])
def test_the_engine_process_of_a_killed_api_server_exits_within_half_a_second(tiny_llama, tmp_path, busy):
    log = (tmp_path / "serve.log").open("w+")
    process, url = spawn_serve(tiny_llama, log, "--engine-process", "--max-model-len", "128", "--num-kv-blocks", "16",
                               "--uvicorn-log-level", "warning")
    try:
        assert wait_until(serving_or_exited(process, url), timeout=120, interval=0.2) and process.poll() is None
        log.seek(0)
        engine_pid = int(re.search(r"engine core: separate process \(pid (\d+)\)", log.read()).group(1))
        stream = None
        if busy:
            stream = httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                                  json={"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True})
            next(stream.__enter__().iter_lines())
        start = time.monotonic()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        exited = wait_until(lambda: gone(engine_pid), timeout=10, interval=0.01)
        took = time.monotonic() - start
        if not exited:
            os.kill(engine_pid, signal.SIGKILL)
        assert exited and took < 0.5, f"the engine process outlived its API server by {took:.2f} s"
    finally:
        if process.poll() is None:
            process.kill()
