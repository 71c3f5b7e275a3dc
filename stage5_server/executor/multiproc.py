"""The multiprocess executor: one worker process per rank, each step sent to all of them.

The engine process keeps the scheduler and the KV accounting and holds no weights. Each worker
process builds the same ``Worker`` a single device uses (its shard or stage of the model, its share
of the KV cache) and serves ``(method, args)`` calls over a pipe, in order, until told to stop or the
pipe closes. Every step goes to every rank, and the driver's answer (the sampled tokens, from TP
rank 0 of the last pipeline stage) comes back. ``execute_model_async`` sends a step and returns at
once: its ``PendingStep`` collects the answers later, so the core can send the next batch while
the pipeline's later stages still run this one (each rank answers its steps in the order sent).
Every worker
process is watched: a rank that exits or errs fails the step at once, naming it, and the others
are stopped. Workers are ``spawn``-ed daemons; a worker whose pipe closes exits by itself.

vLLM: ``vllm/v1/executor/multiproc_executor.py`` (``MultiprocExecutor``, ``WorkerProc``,
``collective_rpc``, the worker monitor); nano-vllm: ``engine/model_runner.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from stage5_server.errors import EngineDeadError
from stage5_server.executor.abstract import Executor, call, start_worker
from stage5_server.parallel.parallel_state import DEFAULT_TIMEOUT_S
from stage5_server.processes import set_process_name, stop_processes

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig
    from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("stagedserve")


class TensorParallelError(EngineDeadError):
    """A tensor-parallel worker died or failed; the engine cannot run any more steps.
    A ``RuntimeError``; as an ``EngineDeadError`` it also stops the server's engine thread."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.world_size = world_size = config.parallel.world_size
        self.driver_rank = config.parallel.world_size - config.parallel.tensor_parallel_size  # TP rank 0, last stage
        self.pending: list[PendingStep] = []  # steps sent whose answers are not collected yet, oldest first
        self.failure: TensorParallelError | None = None
        self._store_dir = tempfile.mkdtemp(prefix="stagedserve-tp-")  # mode 0700: only this user meets here
        store_path = f"{self._store_dir}/rendezvous"
        context = multiprocessing.get_context("spawn")
        self.processes, self.pipes = [], []
        for rank in range(world_size):
            engine_end, worker_end = context.Pipe()
            process = context.Process(target=worker_main, args=(rank, config, store_path, timeout_s, worker_end),
                                      daemon=True, name=f"stagedserve-tp-rank{rank}")
            process.start()
            worker_end.close()
            self.processes.append(process)
            self.pipes.append(engine_end)
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.pipes, self._store_dir)
        self.workers = self._gather_replies("start-up")
        logger.info("model parallel: %d ranks (TP %d x PP %d) up on interface %s: %s", world_size,
                    config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                    config.parallel.distributed_interface,
                    ", ".join(f"rank {w['rank']} pid {w['pid']} {w['device']} stage {w['stage']} "
                              f"({w['num_layers']} layers)" for w in self.workers))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def collective_rpc(self, method: str | Callable, *args) -> list:
        while self.pending:  # answers come in the order sent: the queued steps' first
            self.collect_oldest()
        self._send(method, args)
        return self._gather_replies(method)

    def execute_model_async(self, step: SchedulerOutput) -> PendingStep:
        """Send ``step`` to every rank and return before it has run."""
        self._send("execute_model", (step,))
        pending = PendingStep(self)
        self.pending.append(pending)
        return pending

    def collect_oldest(self) -> None:
        """Wait for the answers to the oldest step sent and hand the driver's to its ``PendingStep``."""
        oldest = self.pending.pop(0)
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine is down: {self.failure}")
        replies = self._gather_replies("execute_model")
        oldest.output, oldest.done = replies[self.driver_rank], True  # the other ranks answer None

    def _send(self, method: str | Callable, args: tuple) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine is down: {self.failure}")
        for rank, pipe in enumerate(self.pipes):
            try:
                pipe.send((method, args))
            except OSError:  # that worker's end is closed: it died
                self._fail(f"rank {rank} is gone (its pipe is closed)", method)

    def _gather_replies(self, what: str) -> list:
        results: list = [None] * self.world_size
        waiting = dict(enumerate(self.pipes))
        while waiting:
            pipes = list(waiting.values())
            ready = wait(pipes + [p.sentinel for p in self.processes])
            for rank, pipe in list(waiting.items()):
                if pipe not in ready:
                    continue
                try:
                    status, payload = pipe.recv()
                except (EOFError, OSError):
                    self._fail(f"rank {rank} closed its pipe", what)
                if status == "error":  # the traceback goes to the log, only its last line into the error
                    logger.error("tensor-parallel rank %d failed during %s:\n%s", rank, what, payload)
                    self._fail(f"rank {rank} raised {payload.strip().splitlines()[-1]}", what)
                results[rank] = payload
                del waiting[rank]
            dead = [(r, p) for r, p in enumerate(self.processes) if p.exitcode is not None]
            if dead and waiting:
                rank, process = dead[0]
                self._fail(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}", what)
        return results

    def _fail(self, reason: str, what: str) -> None:
        # A peer's death usually surfaces first as a collective error on a live rank; give the dead
        # process a moment to be seen, so the error names the cause rather than the symptom.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.processes):
            time.sleep(0.02)
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self.processes) if p.exitcode not in (None, 0)]
        cause = "; ".join(dead) or reason
        self.failure = TensorParallelError(f"tensor-parallel worker failed during {what}: {cause}")
        logger.error("%s; stopping all %d ranks", self.failure, self.world_size)
        self.shutdown()
        raise self.failure

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and remove the rendezvous directory."""
        if self.failure is None:
            self.failure = TensorParallelError("it was shut down")
        self._finalizer()


class PendingStep:
    """A step sent to the ranks; ``result()`` waits for its answers (and those of every step sent before it)."""

    def __init__(self, executor: MultiprocExecutor):
        self.executor = executor
        self.output: ModelRunnerOutput | None = None
        self.done = False

    def result(self) -> ModelRunnerOutput:
        while not self.done:
            self.executor.collect_oldest()
        return self.output


def _stop_workers(processes, pipes, store_dir: str, grace_s: float = 5.0) -> None:
    for pipe in pipes:
        try:
            pipe.send(("shutdown", ()))
        except OSError:
            pass
    stop_processes(processes, grace=grace_s)
    for pipe in pipes:
        pipe.close()
    shutil.rmtree(store_dir, ignore_errors=True)


def worker_main(rank: int, config: EngineConfig, store_path: str, timeout_s: float, conn) -> None:
    """A worker's life: answer ``(method, args)`` with ``("ok", result)`` or ``("error", tb)``; exit after an error."""
    set_process_name(f"ss-tp-{rank}")
    try:
        device = torch.device("cuda", rank) if config.device.type == "cuda" else torch.device("cpu")
        threads = os.environ.get("OMP_NUM_THREADS")  # the ranks share the cores instead of each claiming all
        num_threads = int(threads) if threads else max(1, (os.cpu_count() or 1) // config.parallel.world_size)
        worker = start_worker(config, rank, device, num_threads, store_path, config.parallel.distributed_interface,
                              timeout_s)
        conn.send(("ok", worker.describe()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the engine process is gone: nobody to serve
                break
            if method == "shutdown":
                break
            try:
                result = call(worker, method, args)
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                break
            conn.send(("ok", result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
