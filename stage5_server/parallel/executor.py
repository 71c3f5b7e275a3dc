"""Start one worker process per rank, send every step to all of them, and notice when one dies.

The engine process keeps the scheduler and the KV accounting and holds no weights. Each step
goes down a pipe to every worker (rank 0's answer carries the logits) while every worker
process is watched: a rank that exits or errs fails the step at once, naming it, and the others
are stopped. Workers are ``spawn``-ed daemons; a worker whose pipe closes exits by itself.

vLLM: ``vllm/v1/executor/multiproc_executor.py`` (``MultiprocExecutor``, ``collective_rpc``, the
worker monitor); nano-vllm: ``engine/model_runner.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import time
import weakref
from multiprocessing.connection import wait

import torch

from stage5_server.engine.errors import EngineDeadError
from stage5_server.parallel.parallel_state import DEFAULT_TIMEOUT_S
from stage5_server.parallel.worker import StepBatch, WorkerSettings, worker_main

logger = logging.getLogger("stagedserve")


class TensorParallelError(EngineDeadError):
    """A tensor-parallel worker died or failed; the engine cannot run any more steps.
    A ``RuntimeError``; as an ``EngineDeadError`` it also stops the server's engine thread."""


class MultiprocExecutor:
    def __init__(self, model_path: str, world_size: int, dtype: torch.dtype, device_type: str, interface: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.world_size = world_size
        self.failure: TensorParallelError | None = None
        self._store_dir = tempfile.mkdtemp(prefix="stagedserve-tp-")  # mode 0700: only this user meets here
        settings = WorkerSettings(model_path, world_size, dtype, device_type, interface,
                                  f"{self._store_dir}/rendezvous", timeout_s)
        context = multiprocessing.get_context("spawn")
        self.processes, self.pipes = [], []
        for rank in range(world_size):
            engine_end, worker_end = context.Pipe()
            process = context.Process(target=worker_main, args=(rank, settings, worker_end), daemon=True,
                                      name=f"stagedserve-tp-rank{rank}")
            process.start()
            worker_end.close()
            self.processes.append(process)
            self.pipes.append(engine_end)
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.pipes, self._store_dir)
        self.workers = self._gather_replies("start-up")
        logger.info("tensor parallel: %d ranks up on interface %s: %s", world_size, interface,
                    ", ".join(f"rank {w['rank']} pid {w['pid']} {w['device']}" for w in self.workers))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def collective_rpc(self, method: str, *args) -> list:
        """Call ``method(*args)`` on every worker; their results in rank order."""
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine is down: {self.failure}")
        for rank, pipe in enumerate(self.pipes):
            try:
                pipe.send((method, args))
            except OSError:  # that worker's end is closed: it died
                self._fail(f"rank {rank} is gone (its pipe is closed)", method)
        return self._gather_replies(method)

    def execute_model(self, step: StepBatch) -> torch.Tensor | None:
        return self.collective_rpc("execute_model", step)[0]

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


def _stop_workers(processes, pipes, store_dir: str, grace_s: float = 5.0) -> None:
    for pipe in pipes:
        try:
            pipe.send(("shutdown", ()))
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()
    shutil.rmtree(store_dir, ignore_errors=True)
