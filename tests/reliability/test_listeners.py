"""No serving process listens on all interfaces, in any engine mode (``docs/deploy.md``).

Each test starts the real server (``served.py``), waits until it answers a completion, then lists every listening
TCP socket and bound UDP socket of its whole process tree: the API server, engine cores, coordinator, model
workers and, under the Ray executor, Ray's own GCS, raylet, agents and actors. Every one must be on the loopback,
or on the address ``--host`` names for the HTTP port; never ``0.0.0.0``, ``::`` or another interface's address.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import psutil
import pytest

from stage5_server.executor.ray_executor import RAY_SINGLE_HOST_ENV
from tests.reliability.served import (
    KEY,
    has_ray,
    is_loopback,
    listening_sockets,
    mode_params,
    own_address,
    start,
    stop_and_leave_nothing,
    tree,
)
from tests.stage5.server_fixtures import auth


def serve_one_and_list(tiny_llama, tmp_path, mode: str, host: str | None = None) -> tuple[list, list[str]]:
    """The listening sockets of ``mode``'s server once it has answered a completion, and the names of its processes."""
    process, url = start(tiny_llama, tmp_path, mode, host=host)
    pids = []
    try:
        response = httpx.post(f"{url}/v1/completions", headers=auth(KEY), timeout=120,
                              json={"prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        processes = tree(psutil.Process(process.pid))
        pids = [p.pid for p in processes]
        names = [p.name() for p in processes]
        return listening_sockets(processes), names
    finally:
        assert stop_and_leave_nothing(process, pids) == []


@pytest.mark.parametrize("mode", mode_params())
def test_every_socket_of_every_serving_process_is_on_the_loopback(tiny_llama, tmp_path, mode):
    sockets, names = serve_one_and_list(tiny_llama, tmp_path, mode)
    exposed = [s for s in sockets if not is_loopback(s[2])]
    assert not exposed, f"listening beyond the loopback (name, pid, address, port, kind): {exposed}"
    assert any(kind == "tcp" for *_, kind in sockets), "the HTTP server listens"
    if mode.startswith("ray"):  # Ray's own servers were in the tree that was checked
        assert {"gcs_server", "raylet"} <= set(names), names


@pytest.mark.slow
@pytest.mark.parametrize("mode", mode_params(("engine-process", "ray-tp2")))
def test_a_named_host_gets_the_http_port_and_nothing_else_leaves_the_loopback(tiny_llama, tmp_path, mode):
    host = own_address()
    if host is None:
        pytest.skip("this machine has no address besides the loopback")
    sockets, _ = serve_one_and_list(tiny_llama, tmp_path, mode, host=host)
    named = [s for s in sockets if s[2] == host]
    assert len(named) == 1 and named[0][4] == "tcp", sockets  # the HTTP port, on exactly that address
    others = [s for s in sockets if s[2] != host and not is_loopback(s[2])]
    assert not others, f"listening beyond the loopback and {host}: {others}"


@pytest.mark.slow
@pytest.mark.skipif(not has_ray(), reason="needs ray")
def test_ray_imported_too_early_to_stay_on_the_loopback_is_refused_rather_than_started(tiny_llama):
    if own_address() is None:
        pytest.skip("Ray takes the loopback for this host's address: it would stay there")
    script = ("import ray\nfrom stage5_server import LLM\n"
              f"LLM(model={str(tiny_llama)!r}, tensor_parallel_size=2, distributed_executor_backend='ray', "
              "max_model_len=128, num_kv_blocks=16)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", RAY_SINGLE_HOST_ENV)})
    assert done.returncode != 0
    assert "Ray was imported before the engine started it" in done.stderr, done.stderr[-2000:]
    assert "Started a local Ray instance" not in done.stderr
