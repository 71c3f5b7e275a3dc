"""``stagedserve serve --api-server-count A`` (A > 1): A API-server processes on one port, over N engine cores.

    supervisor (this process; it serves no request)
      |- coordinator                  (N > 1)
      |- engine core 0 .. N-1         (each with its tensor-parallel workers when TP > 1)
      '- API server 0 .. A-1          (uvicorn + MPAsyncLLM, each connected to every engine core)

The supervisor binds the socket once and hands each API server a copy (as vLLM does): all accept
from one kernel queue, so a dead API server loses only the connections it had accepted. All get
the same keys and ``CacheSalter`` secret, and a shared ``PROMETHEUS_MULTIPROC_DIR``. A dead API
server is restarted and the cores abort its requests (``ClientGone``); if the supervisor dies,
every child exits. SIGTERM or SIGINT drains: the socket closes, requests in flight get up to
``--shutdown-timeout`` seconds, then the engine cores and the coordinator stop.

vLLM: ``run_multi_api_server`` and ``run_api_server_worker_proc`` in
``vllm/entrypoints/cli/serve.py``, ``APIServerProcessManager`` and ``wait_for_completion_or_failure``
in ``vllm/v1/utils.py`` (vLLM shuts everything down when any process dies).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from stage5_server.cli.options import log_api_keys, log_engine, log_level
from stage5_server.data_parallel.launcher import CoreEngineProcManager, EngineTopology
from stage5_server.processes import configure_child, set_process_name, stop_processes
from stage5_server.server.config import ServerConfig

logger = logging.getLogger("stagedserve")

QUICK_DEATH_S = 10.0  # an API server that dies this soon after starting, three times running, is not restarted
MAX_QUICK_DEATHS = 3
BACKLOG = 2048


@dataclasses.dataclass(frozen=True)
class APIServerConfig:
    """What one API-server process needs (it pickles: the supervisor hands it over at spawn)."""

    topology: EngineTopology
    server: ServerConfig  # the same for every API server: keys, cache-salt secret, limits, adapters at start
    log_level: str
    shutdown_timeout: float


def bind_listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def run_api_server_worker(index: int, config: APIServerConfig, sock: socket.socket) -> None:
    """One API-server process: an ``MPAsyncLLM`` over every engine core, an app, uvicorn on the shared socket."""
    import uvicorn

    from stage5_server.engine.mp_client import MPAsyncLLM
    from stage5_server.server import create_app

    # uvicorn handles SIGTERM and SIGINT itself (a drain).
    configure_child(f"ss-api-{index}", f"api-server {index}", log_level(config.log_level), signals=False)
    parent = os.getppid()
    engine = MPAsyncLLM.connect(config.topology, client_index=index,
                                log_stats_interval=config.server.log_stats_interval)
    app = create_app(engine, config.server)
    # log_config=None: uvicorn's own lines go through the format above, so each names its API server.
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, log_config=None, lifespan="on",
                                           timeout_graceful_shutdown=config.shutdown_timeout))

    def watch_parent() -> None:  # an orphan must not keep the port
        while not server.should_exit:
            if os.getppid() != parent:
                logger.error("the supervisor is gone; exiting")
                server.should_exit = True
            time.sleep(0.5)

    threading.Thread(target=watch_parent, name="stagedserve-watch-parent", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()


class APIServerProcessManager:
    """A API-server processes on one socket; restarts one that dies (not one that keeps dying at start-up)."""

    def __init__(self, count: int, config: APIServerConfig, sock: socket.socket):
        self.config = config
        self.sock = sock
        self._context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process | None] = [None] * count
        self._started = [0.0] * count
        self._quick_deaths = [0] * count
        for index in range(count):
            self.start(index)

    def start(self, index: int, config: APIServerConfig | None = None) -> None:
        process = self._context.Process(target=run_api_server_worker, name=f"stagedserve-api-server-{index}",
                                        args=(index, config or self.config, self.sock))
        process.start()
        self.processes[index] = process
        self._started[index] = time.monotonic()
        logger.info("API server %d: pid %d", index, process.pid)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p is not None]

    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.processes if p is not None]

    def reap(self, manager: CoreEngineProcManager) -> None:
        """Restart each API server that has died; the engine cores abort what it had in flight."""
        for index, process in enumerate(self.processes):
            if process is None or process.is_alive():
                continue
            process.join()
            client_id = f"api{index}-{process.pid}"  # MPAsyncLLM's identity for it
            manager.client_gone(client_id)
            quick = time.monotonic() - self._started[index] < QUICK_DEATH_S
            self._quick_deaths[index] = self._quick_deaths[index] + 1 if quick else 0
            if self._quick_deaths[index] >= MAX_QUICK_DEATHS:
                logger.error("API server %d (pid %d) exited with code %s, %d times in a row right after start; "
                             "not restarting it", index, process.pid, process.exitcode, MAX_QUICK_DEATHS)
                self.processes[index] = None
                continue
            logger.error("API server %d (pid %d) exited with code %s; its connections are lost, the engine cores "
                         "abort its requests; restarting it", index, process.pid, process.exitcode)
            live_topology = dataclasses.replace(self.config.topology, dead_ranks=manager.dead_ranks())
            self.start(index, dataclasses.replace(self.config, topology=live_topology))

    def any_alive(self) -> bool:
        return any(p is not None for p in self.processes)

    def stop(self, timeout: float) -> None:
        """SIGTERM each (uvicorn drains for up to ``--shutdown-timeout``), then kill what is left."""
        stop_processes([p for p in self.processes if p is not None], timeout)


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop


def run_multi_api_server(args: argparse.Namespace, model: str | None, engine_kwargs: dict[str, Any],
                         server: ServerConfig, batch_defaults: dict[str, int] | None = None) -> int:
    """``server`` was checked when it was built, before any process starts; the API servers get it with one
    cache-salt secret for all, so a trust group's cached prefixes are shared across them."""
    from stage5_server.server.auth import APIKeys

    groups = APIKeys(server.api_keys).groups if server.api_keys is not None else []
    server = dataclasses.replace(server, cache_salt_secret=server.cache_salt_secret or secrets.token_bytes(32))
    set_process_name("ss-supervisor")
    metrics_dir = tempfile.mkdtemp(prefix="stagedserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API servers
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    sock = manager = api_servers = None
    try:
        sock = bind_listening_socket(args.host, args.port)
        try:
            manager = CoreEngineProcManager(model, {**(batch_defaults or {}), **engine_kwargs}, args.data_parallel_size,
                                            api_server_count=args.api_server_count, routing=args.dp_routing)
        except ValueError as exc:
            print(f"stagedserve serve: error: {exc}", flush=True)
            return 2
        ready = manager.topology.ready[0]
        log_engine(ready.model_path, server.served_model_name, engine_kwargs, ready.stage, ready.engine_args)
        log_api_keys(args, server.api_keys, groups)
        config = APIServerConfig(manager.topology, server, args.uvicorn_log_level, args.shutdown_timeout)
        api_servers = APIServerProcessManager(args.api_server_count, config, sock)
        logger.info("serving on http://%s:%d: %d API server(s) (pids %s) over %d engine core(s)", args.host,
                    args.port, args.api_server_count, ", ".join(map(str, api_servers.pids)),
                    args.data_parallel_size)
        reported_dead: set[int] = set()
        while api_servers.any_alive():
            wait([*api_servers.sentinels(), *(p.sentinel for p in manager.processes)], timeout=1.0)
            api_servers.reap(manager)
            for rank in manager.dead_ranks() - reported_dead:
                logger.error("engine core rank %d exited (code %s); the API servers route around it", rank,
                             manager.processes[rank].exitcode)
                reported_dead.add(rank)
        logger.error("no API server left; exiting")
        return 1
    except _Stop:
        logger.info("shutting down: draining the API servers for up to %g s", args.shutdown_timeout)
        return 0
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second signal does not cut the drain short
        if sock is not None:
            sock.close()  # with every API server's copy closed too, new connections are refused
        if api_servers is not None:
            api_servers.stop(args.shutdown_timeout + 10)
        if manager is not None:
            manager.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
