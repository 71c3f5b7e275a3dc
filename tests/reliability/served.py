"""``stagedserve serve`` as a real process tree in each engine mode, for the tests that look at its processes and
sockets from outside (``test_listeners.py``, ``test_worker_death.py``).

The modes: the engine core on a thread of the server (``thread``), in a process of its own (``engine-process``,
the default), two data-parallel ranks (``dp2``), a model split by tensor or pipeline parallelism over worker
processes (``tp2``, ``pp2``), and the same splits over Ray actors (``ray-tp2``, ``ray-pp2``: a Ray instance the
server starts for this host alone).
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.stage5.server_fixtures import serving_or_exited, spawn_serve, wait_until

KEY = "served-key"
RAY = ("--distributed-executor-backend", "ray")
MODE_FLAGS = {
    "thread": ("--no-engine-process",),
    "engine-process": (),
    "dp2": ("--data-parallel-size", "2", "--api-server-count", "1"),
    "tp2": ("--tensor-parallel-size", "2"),
    "pp2": ("--pipeline-parallel-size", "2"),
    "ray-tp2": (*RAY, "--tensor-parallel-size", "2"),
    "ray-pp2": (*RAY, "--pipeline-parallel-size", "2"),
}


def mode_params(modes=tuple(MODE_FLAGS)) -> list:
    """``modes`` as pytest params, each starting a server of its own (all slow: 10 s to a minute); Ray's need Ray."""
    def marks(mode: str) -> list:
        return [pytest.mark.slow, *([pytest.mark.skipif(not has_ray(), reason="needs ray")]
                                   if mode.startswith("ray") else [])]

    return [pytest.param(mode, id=mode, marks=marks(mode)) for mode in modes]


def has_ray() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def start(model, tmp_path: Path, mode: str, *flags: str, host: str | None = None,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """The server of ``mode`` on ``model``, serving (``/health`` 200); its process and URL. Without ``RAY_ADDRESS``
    the Ray modes start a Ray instance of their own."""
    extra = ("--host", host) if host else ()
    for attempt in range(3):
        log = (tmp_path / f"serve-{mode}-{attempt}.log").open("w+")
        process, url = spawn_serve(model, log, *MODE_FLAGS[mode], *extra, "--max-model-len", "256",
                                   "--num-kv-blocks", "64", "--log-stats-interval", "0", "--uvicorn-log-level",
                                   "warning", *flags, env={"STAGEDSERVE_API_KEY": KEY, "OMP_NUM_THREADS": "1",
                                                           **(env or {})})
        if host:
            url = url.replace("127.0.0.1", f"[{host}]" if ":" in host else host)
        if wait_until(serving_or_exited(process, url), timeout=300, interval=0.3) and process.poll() is None:
            break
        process.kill()
        process.wait()
        log.seek(0)
        text = log.read()
        if "address already in use" not in text:  # only a port taken since it was picked (Ray's many ports) retries
            raise AssertionError(f"the {mode} server did not start:\n{text[-4000:]}")
    else:
        raise AssertionError(f"the {mode} server found its port taken three times")
    return process, url


def tree(root: psutil.Process) -> list[psutil.Process]:
    """``root`` and every process below it (Ray's GCS, raylet, agents and workers included)."""
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listening_sockets(processes: list[psutil.Process]) -> list[tuple[str, int, str, int, str]]:
    """Every TCP socket listening and every UDP socket bound in ``processes``: (name, pid, address, port, kind)."""
    found = []
    for proc in processes:
        try:
            name, connections = proc.name(), proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for conn in connections:
            listening = conn.status == psutil.CONN_LISTEN if conn.type == socket.SOCK_STREAM else not conn.raddr
            if listening and conn.laddr:
                kind = "tcp" if conn.type == socket.SOCK_STREAM else "udp"
                found.append((name, proc.pid, conn.laddr.ip, conn.laddr.port, kind))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as a dual-stack socket shows the IPv4 loopback
    return (mapped or ip).is_loopback


def own_address() -> str | None:
    """An IPv4 address of this machine other than the loopback, on an interface that is up; None if it has none."""
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        for address in addresses:
            if address.family == socket.AF_INET and not is_loopback(address.address):
                return address.address
    return None


def gone(pids: list[int]) -> bool:
    """True once none of ``pids`` runs (a zombie waiting for its parent counts as gone)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def stop_and_leave_nothing(process: subprocess.Popen, pids: list[int], timeout: float = 60) -> list[str]:
    """SIGINT the server; the processes of ``pids`` still running once it has exited (a second's grace for the
    last exits to be seen), killed and named: none, when every process waits for those it started."""
    import signal

    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    wait_until(lambda: gone(pids), timeout=1, interval=0.05)
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.name()} (pid {pid})")
                proc.kill()
        except psutil.NoSuchProcess:
            pass
    return left
