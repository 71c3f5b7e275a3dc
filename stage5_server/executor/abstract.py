"""What every executor is, and the one start-up every rank runs.

An executor answers ``collective_rpc`` (a method on every worker, their results in rank order) and
``execute_model`` (one step on every worker, the driver's answer: TP rank 0 of the last pipeline
stage). ``execute_model_async`` returns a ``PendingStep`` whose ``result()`` is that answer: an
executor whose workers run in other processes returns before the step has run, so the core can queue
the next batch while a pipeline's later stages still work on this one.

Every rank starts the same way, in this process, a worker process or a Ray actor (``start_worker``):
its share of the CPU's threads, its place in the process group when the model is split, then the
worker its runner kind names (``EngineConfig.worker_cls``: the generating ``Worker``, or the pooling
room's), built without this package importing the room it lives in, with the extension the config names
beside it (``worker_extension_cls``).

vLLM: ``vllm/v1/executor/abstract.py`` (``Executor``) and ``WorkerWrapperBase``
in ``vllm/v1/worker/worker_base.py`` (the worker built from ``parallel_config.worker_cls``, and
``worker_extension_cls``, whose methods vLLM adds to the worker's class; here the extension is an object beside
the worker).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stage5_server.parallel.parallel_state import DEFAULT_TIMEOUT_S, RankPlace, init_model_parallel

if TYPE_CHECKING:
    import torch.distributed as dist

    from stage5_server.config import EngineConfig
    from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput


class PendingStep(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class DoneStep:
    """A step that has already run (one process has nothing to overlap it with)."""

    def __init__(self, output: ModelRunnerOutput):
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor:
    world_size: int = 1
    driver_rank: int = 0

    def collective_rpc(self, method: str | Callable, *args: Any) -> list:
        """``method(*args)`` on every worker (a function: ``method(worker, *args)``); their results in rank order."""
        raise NotImplementedError

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(step).result()

    def execute_model_async(self, step: SchedulerOutput) -> PendingStep:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


def call(worker: Any, method: str | Callable, args: tuple) -> Any:
    """One ``collective_rpc`` call on one worker (a name: its method, or its extension's)."""
    if not isinstance(method, str):
        return method(worker, *args)
    fn = worker_method(worker, method)
    if fn is None:
        raise AttributeError(f"{type(worker).__name__} has no method {method!r}")
    return fn(*args)


def worker_method(worker: Any, name: str) -> Callable | None:
    """The worker's method ``name``: its own, else its extension's (``EngineConfig.worker_extension_cls``, set by
    ``make_worker``); None if neither has one."""
    for owner in (worker, getattr(worker, "extension", None)):
        fn = None if owner is None else getattr(owner, name, None)
        if callable(fn):
            return fn
    return None


def resolve_obj_by_qualname(qualname: str) -> Any:
    """``"package.module:name"`` -> that object, its module imported now."""
    module, _, name = qualname.partition(":")
    return getattr(importlib.import_module(module), name)


def make_worker(config: EngineConfig, rank: int = 0, device: torch.device | None = None) -> Any:
    """The worker of ``config``'s runner kind (``EngineConfig.worker_cls``) for ``rank``, and its extension if the
    config names one (``worker_extension_cls``: a class built over the worker, whose methods ``collective_rpc``
    reaches beside the worker's own, as weight updates and sleep do: ``weight_sync/worker.py``)."""
    worker = resolve_obj_by_qualname(config.worker_cls)(config, rank, device)
    if config.worker_extension_cls is not None:
        worker.extension = resolve_obj_by_qualname(config.worker_extension_cls)(worker)
    return worker


def start_worker(config: EngineConfig, rank: int, device: torch.device, num_threads: int,
                 store: str | dist.Store | None = None, interface: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A rank's start-up: ``num_threads`` torch threads on a CPU; with a split model, its place in the process
    group (rendezvous through ``store``, traffic on ``interface``); then its worker, which loads its weights."""
    if device.type == "cpu":
        torch.set_num_threads(num_threads)
    parallel = config.parallel
    if parallel.world_size > 1:
        place = RankPlace(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        init_model_parallel(place, store, interface, device, timeout_s)
    return make_worker(config, rank, device)
