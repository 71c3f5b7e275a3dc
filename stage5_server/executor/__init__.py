"""Executors: where the workers live. The engine core calls ``execute_model`` and ``collective_rpc``
and cannot tell which one it has (``abstract.py``: the base, and the one start-up of every rank).

- ``UniProcExecutor`` (``uniproc.py``): one worker in the engine core's process;
- ``MultiprocExecutor`` (``multiproc.py``): one worker process per rank (tensor-parallel rank x
  pipeline stage), on this host;
- ``RayExecutor`` (``ray_executor.py``): one Ray actor per rank, placed by a placement group on any
  host of a Ray cluster (``distributed_executor_backend="ray"``).

vLLM: ``vllm/v1/executor/abstract.py`` (``Executor.get_class``), ``uniproc_executor.py``,
``multiproc_executor.py``, ``ray_executor.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stage5_server.executor.abstract import DoneStep, Executor, PendingStep, make_worker

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig


def make_executor(config: EngineConfig) -> Executor:
    """The executor for ``config``: Ray actors, one worker process per rank of a split model, or this process
    (vLLM's ``Executor.get_class``)."""
    if config.parallel.distributed_executor_backend == "ray":
        from stage5_server.executor.ray_executor import RayExecutor  # Ray is imported only when asked for

        return RayExecutor(config)
    if config.parallel.world_size > 1:
        from stage5_server.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from stage5_server.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)


__all__ = ["DoneStep", "Executor", "PendingStep", "make_executor", "make_worker"]
