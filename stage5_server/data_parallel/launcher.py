"""Start the engine-core processes (and, for more than one, their coordinator), and watch them.

One engine process is data parallelism of size 1. ``--data-parallel-size N`` runs N, each a
whole engine on its own slice of the machine: on CUDA rank d sees GPUs ``d*TP .. d*TP+TP-1``
(``CUDA_VISIBLE_DEVICES``), on a CPU it runs ``cores // N`` threads. Each binds its sockets
(``core/core_proc.run_engine_core``) and reports ``EngineCoreReady`` or its start-up error: the one
start-up handshake. ``EngineTopology`` (it pickles) is what an API server needs to connect. A
finalizer stops the processes; each also exits with its parent.

vLLM: ``CoreEngineProcManager`` and ``launch_core_engines`` in ``vllm/v1/engine/utils.py``
(with ``set_device_control_env_var`` for the per-rank devices).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from stage5_server.core.core_proc import run_engine_core
from stage5_server.core.messages import (
    ClientGone,
    EngineCoreInput,
    EngineCoreReady,
    EngineCoreStartupError,
    Shutdown,
    encoder,
    open_socket,
    output_decoder,
)
from stage5_server.data_parallel.coordinator import DPCoordinator
from stage5_server.data_parallel.routing import LEAST_LOADED, check_routing
from stage5_server.processes import stop_processes

logger = logging.getLogger("stagedserve")

DEFAULT_STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class EngineTopology:
    """Where the engine cores listen and what they run: everything an API server needs to connect."""

    input_addresses: tuple[str, ...]  # rank d's PULL
    output_addresses: tuple[str, ...]  # rank d's ROUTER
    stats_address: str | None  # the coordinator's PUB (None: DP = 1, no coordinator)
    ready: tuple[EngineCoreReady, ...]  # rank d's resolved configuration
    api_server_count: int = 1
    routing: str = LEAST_LOADED
    dead_ranks: frozenset[int] = field(default_factory=frozenset)  # known dead when an API server starts

    @property
    def data_parallel_size(self) -> int:
        return len(self.ready)


def check_topology(data_parallel_size: Any, api_server_count: Any, routing: Any) -> None:
    for name, value in (("data_parallel_size", data_parallel_size), ("api_server_count", api_server_count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    check_routing(routing)


def plan_devices(engine_args: dict[str, Any], data_parallel_size: int) -> list[dict[str, str]]:
    """Each rank's environment: its GPUs on CUDA (``ValueError`` if too few), its share of the cores on CPU."""
    import torch

    if data_parallel_size == 1:
        return [{}]  # the whole machine as given (on a CPU a thread per physical core: core/cpu_threads.py)
    tp = (engine_args.get("tensor_parallel_size") or 1) * (engine_args.get("pipeline_parallel_size") or 1)
    device = str(engine_args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.startswith("cuda"):
        if data_parallel_size > 1 and device != "cuda":
            raise ValueError(f"device: give 'cuda' with data_parallel_size > 1 (rank d uses GPUs d*TP .. "
                             f"d*TP+TP-1), not {device!r}")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible is not None else \
            [str(i) for i in range(torch.cuda.device_count())]
        if data_parallel_size * tp > len(gpus):
            raise ValueError(f"data_parallel_size: {data_parallel_size} ranks x {tp} model-parallel ranks need "
                             f"{data_parallel_size * tp} GPUs; {len(gpus)} visible")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[d * tp:(d + 1) * tp])} for d in range(data_parallel_size)]
    user_threads = os.environ.get("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = int(user_threads) if user_threads else max(1, cores // data_parallel_size)
    return [{"OMP_NUM_THREADS": str(threads if tp == 1 else max(1, threads // tp))} for _ in range(data_parallel_size)]


@contextlib.contextmanager
def environment(updates: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``updates`` while a child is spawned (it inherits the environment then)."""
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class CoreEngineProcManager:
    """N engine-core processes (and the coordinator when N > 1), started and ready, or an exception
    (``ValueError``, ``RuntimeError``, ``TimeoutError``) once whatever had started is stopped."""

    def __init__(self, model: str | None, engine_args: dict[str, Any], data_parallel_size: int = 1, *,
                 api_server_count: int = 1, routing: str = LEAST_LOADED,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, log_level: int | None = None):
        check_topology(data_parallel_size, api_server_count, routing)
        log_level = logger.getEffectiveLevel() if log_level is None else log_level
        envs = plan_devices(engine_args, data_parallel_size)
        self._ipc_dir = tempfile.mkdtemp(prefix="stagedserve-dp-")  # mode 0700: only this user connects
        ipc = f"ipc://{self._ipc_dir}"
        inputs = tuple(f"{ipc}/engine{d}-input" for d in range(data_parallel_size))
        outputs = tuple(f"{ipc}/engine{d}-output" for d in range(data_parallel_size))
        self._context = zmq.Context()
        handshake = open_socket(self._context, zmq.PULL, bind=f"{ipc}/handshake", LINGER=0)
        self.coordinator = DPCoordinator(data_parallel_size, f"{ipc}/coordinator-stats",
                                         f"{ipc}/coordinator-publish", log_level) if data_parallel_size > 1 else None
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        for d in range(data_parallel_size):
            split = (engine_args.get("tensor_parallel_size") or 1) * (engine_args.get("pipeline_parallel_size") or 1)
            threads = envs[d].get("OMP_NUM_THREADS") if split == 1 else None
            process = context.Process(
                target=run_engine_core, name=f"stagedserve-engine-core-{d}",
                args=(d, model, dict(engine_args), inputs[d], outputs[d], f"{ipc}/handshake",
                      self.coordinator.stats_address if self.coordinator else None, os.getpid(),
                      int(threads) if threads else None, log_level))
            with environment(envs[d]):
                process.start()
            logger.info("engine core rank %d: pid %d, %s", d, process.pid,
                        ", ".join(f"{k}={v}" for k, v in envs[d].items()))
            self.processes.append(process)
        self._controls: list[zmq.Socket] = []
        self._finalizer = weakref.finalize(self, _stop_all, self.processes, self.coordinator, self._context,
                                           self._controls, self._ipc_dir)
        try:
            ready = self._wait_until_ready(handshake, startup_timeout_s)
        except BaseException:
            handshake.close()
            self.shutdown()
            raise
        handshake.close()
        for address in inputs:  # for Shutdown and ClientGone
            self._controls.append(open_socket(self._context, zmq.PUSH, connect=address, LINGER=1000))
        self.topology = EngineTopology(inputs, outputs, self.coordinator.publish_address if self.coordinator else None,
                                       tuple(ready), api_server_count, routing)
        logger.info("data parallel: %d engine core(s) ready (pids %s)%s", data_parallel_size,
                    ", ".join(str(p.pid) for p in self.processes),
                    f", coordinator pid {self.coordinator.pid}" if self.coordinator else "")

    def _wait_until_ready(self, handshake: zmq.Socket, timeout_s: float) -> list[EngineCoreReady]:
        ready: dict[int, EngineCoreReady] = {}
        poller = zmq.Poller()
        poller.register(handshake, zmq.POLLIN)
        for process in self.processes:
            poller.register(process.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self.processes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(self.processes) - len(ready)} engine core(s) did not start within "
                                   f"{timeout_s:g} s")
            events = dict(poller.poll(remaining * 1000))
            if handshake in events:
                message = output_decoder.decode(handshake.recv())
                if isinstance(message, EngineCoreReady):
                    ready[message.engine_index] = message
                elif isinstance(message, EngineCoreStartupError):
                    if message.error_type == "ValueError":
                        raise ValueError(message.message)
                    raise RuntimeError(f"engine core rank {message.engine_index} failed to start: "
                                       f"{message.error_type}: {message.message}\n{message.traceback}")
            else:
                for d, process in enumerate(self.processes):
                    if process.sentinel in events and d not in ready:
                        process.join(1)
                        raise RuntimeError(f"engine core rank {d} exited during start-up "
                                           f"(exit code {process.exitcode})")
        return [ready[d] for d in range(len(self.processes))]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def dead_ranks(self) -> frozenset[int]:
        return frozenset(d for d, p in enumerate(self.processes) if not p.is_alive())

    def send_to_all(self, message: EngineCoreInput) -> None:
        for control in self._controls:
            if not control.closed:
                control.send(encoder.encode(message), zmq.NOBLOCK)

    def client_gone(self, client_id: str) -> None:
        """An API server died: every rank aborts its requests."""
        self.send_to_all(ClientGone(client_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask every rank to exit, then stop whatever is left (coordinator included)."""
        if self._finalizer.alive:
            try:
                self.send_to_all(Shutdown())
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()


def _stop_all(processes: list[multiprocessing.Process], coordinator: DPCoordinator | None, context: zmq.Context,
              controls: list[zmq.Socket], ipc_dir: str) -> None:
    for control in controls:
        control.close(linger=0)
    stop_processes(processes)
    if coordinator is not None:
        coordinator.shutdown()
    context.term()
    shutil.rmtree(ipc_dir, ignore_errors=True)
