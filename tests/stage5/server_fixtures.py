"""Helpers for the server tests: a small engine, uvicorn on a loopback port, SSE and metrics parsing.

Each test module starts one real server (uvicorn on a thread, a port picked by the OS)
and shares it; nothing here is a pytest fixture, so modules compose what they need.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from stage5_server import LLM
from stage5_server.server import ServerThread

REPO = Path(__file__).resolve().parents[2]

# Small and quick on CPU: every prompt + max_tokens in the tests fits max_model_len=256.
ENGINE_KWARGS = dict(max_model_len=256, max_num_seqs=16, block_size=16, num_kv_blocks=160,
                     max_num_batched_tokens=256)


def make_llm(model_path, **overrides) -> LLM:
    return LLM(model=str(model_path), **{**ENGINE_KWARGS, **overrides})


@contextmanager
def running_server(app) -> Iterator[ServerThread]:
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class LoopbackHTTPServer:
    """An HTTP server on 127.0.0.1, on a port the OS picks, serving ``handler`` on a thread of its own."""

    def __init__(self, handler: type):
        import http.server

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tiny_llava_app(model_path, key: str):
    """The app over the tiny LLaVA (``tiny-llava``), one key, small prefill chunks (an image spans several)."""
    from stage5_server.server import create_app

    llm = make_llm(model_path, dtype="float32", device="cpu", attention_backend="torch", max_num_batched_tokens=32)
    return create_app(llm, api_keys=[key], served_model_name="tiny-llava", log_stats_interval=None)


@contextmanager
def media_rules(serving, **options) -> Iterator[None]:
    """The server's media rules (``MediaOptions``) for the duration of a test: what the flags and variables set."""
    from stage5_server.server.media import MediaConnector, MediaOptions

    before = serving.media
    serving.media = MediaConnector(MediaOptions(**options))
    try:
        yield
    finally:
        serving.media = before


def sse_events(lines: Iterable[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE stream: dicts, and the string ``"[DONE]"``.

    Checks the framing: every non-empty line is a ``data: `` line.
    """
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from Prometheus text (summed over samples matching ``labels``)."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    return total if found else None


def engine_runner(llm_or_core) -> tuple[Any, str]:
    """The model runner that runs a step's forward pass, and the name of that method: stage 5's driver
    worker's ``execute_model`` (given its ``LLM`` or its engine core), stages 1-4's ``runner.execute``."""
    engine = getattr(llm_or_core, "engine", llm_or_core)
    executor = getattr(engine, "model_executor", None)
    if executor is not None:
        return executor.driver_worker.model_runner, "execute_model"
    return engine.runner, "execute"


def engine_kv_cache(llm) -> Any:
    """The paged KV cache the forward pass writes (stage 5: its driver worker's)."""
    executor = getattr(llm.engine, "model_executor", None)
    return llm.engine.kv_cache if executor is None else executor.driver_worker.kv_cache


def fail_execute(monkeypatch, llm, *, on_call: int = 1, times: int = 1, min_requests: int = 0) -> dict[str, int]:
    """Make the runner's forward pass raise on its ``on_call``-th call (1-based), ``times`` times in a row;
    with ``min_requests``, only on a stage 5 step that carries at least that many requests."""
    runner, method = engine_runner(llm)
    original = getattr(runner, method)
    state = {"calls": 0, "failures": 0}

    def execute(*args, **kwargs):
        state["calls"] += 1
        carried = len(getattr(args[0], "scheduled_req_ids", ())) if args else 0
        if state["calls"] >= on_call and carried >= min_requests and state["failures"] < times:
            state["failures"] += 1
            raise RuntimeError("injected engine failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, method, execute)
    return state


class EngineCallRecorder:
    """Wraps the engine core's ``add_request`` / ``step`` / ``finish_requests`` to record each request's
    cache salt and the threads that call the core."""

    def __init__(self, llm):
        self.core = llm.engine
        self.salts: dict[str, str | None] = {}
        self.threads: set[str] = set()
        self._lock = threading.Lock()
        self._originals = {name: getattr(self.core, name) for name in ("add_request", "step", "finish_requests")}
        for name, original in self._originals.items():
            setattr(self.core, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            with self._lock:
                self.threads.add(threading.current_thread().name)
                if name == "add_request":
                    request = args[0]
                    self.salts[request.request_id] = request.cache_salt
            return original(*args, **kwargs)

        return wrapper

    def restore(self) -> None:
        for name in self._originals:
            delattr(self.core, name)  # back to the class's method


def spawn_serve(model, log: IO, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m stage5_server serve MODEL --port P *args`` as a process of its own, writing to ``log``
    (no MODEL when ``model`` is None: the default); returns the process and its URL (wait for it
    with ``serving_or_exited``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model_arg = [] if model is None else [str(model)]
    process = subprocess.Popen([sys.executable, "-m", "stage5_server", "serve", *model_arg, "--port", str(port), *args],
                               cwd=REPO, env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)},
                               stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def stop_serve(process: subprocess.Popen, timeout: float = 60) -> int:
    """Ctrl-C for a ``spawn_serve`` process; its exit code (killed, and the timeout raised, if it hangs)."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def serving_or_exited(process: subprocess.Popen, url: str) -> Callable[[], bool]:
    """For ``wait_until``: true once ``/health`` answers 200, or once the process has exited."""
    import httpx

    def done() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return process.poll() is not None

    return done


PROCESS_ROLES = (("ss-supervisor", "supervisor"), ("ss-coordinator", "coordinator"), ("ss-engine", "engine_cores"),
                 ("ss-tp", "workers"), ("ss-api", "api_servers"))


def serving_processes(root: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The process tree of ``stagedserve serve`` by role, from the names each process gives itself
    (multiprocessing's resource tracker is no serving process and is left out)."""
    roles: dict[str, list[psutil.Process]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            name, cmdline = proc.name(), " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "resource_tracker" in cmdline:
            continue
        # Unnamed: the ``stagedserve serve`` process itself, the API server when A = 1.
        role = next((role for prefix, role in PROCESS_ROLES if name.startswith(prefix)), "api_servers")
        roles.setdefault(role, []).append(proc)
    return roles


def counts_of(roles: dict[str, list[psutil.Process]]) -> dict[str, int]:
    """How many processes of each role, as ``cli.serve.serving_process_count`` gives them."""
    counts = {role: len(roles.get(role, [])) for role in
              ("api_servers", "engine_cores", "workers", "coordinator", "supervisor")}
    counts["total"] = sum(counts.values())
    return counts
