"""Executors: where the workers live. The engine core calls ``execute_model`` and ``collective_rpc``
and cannot tell which one it has.

- ``UniProcExecutor`` (``uniproc.py``): one worker in the engine core's process;
- ``MultiprocExecutor`` (``multiproc.py``): one worker process per rank (tensor-parallel rank x
  pipeline stage), on this host;
- ``RayExecutor`` (``ray_executor.py``): one Ray actor per rank, placed by a placement group on any
  host of a Ray cluster (``distributed_executor_backend="ray"``).

Both answer ``execute_model_async`` with a ``PendingStep`` whose ``result()`` is the driver's output:
the multiprocess one returns before the step has run, so the core can queue the next batch while a
pipeline's later stages still work on this one.

vLLM: ``vllm/v1/executor/abstract.py`` (``Executor.get_class``), ``uniproc_executor.py``,
``multiproc_executor.py``, ``ray_executor.py``.
"""

from __future__ import annotations

from stage5_server.config import EngineConfig
from stage5_server.executor.multiproc import MultiprocExecutor, PendingStep, TensorParallelError
from stage5_server.executor.uniproc import DoneStep, UniProcExecutor

Executor = UniProcExecutor | MultiprocExecutor


def make_executor(config: EngineConfig) -> Executor:
    """The executor for ``config``: one worker process per rank when the model is split, else this process."""
    if config.parallel.distributed_executor_backend == "ray":
        from stage5_server.executor.ray_executor import RayExecutor  # Ray is imported only when asked for

        return RayExecutor(config)
    if config.parallel.world_size > 1:
        return MultiprocExecutor(config)
    return UniProcExecutor(config)


__all__ = ["DoneStep", "Executor", "MultiprocExecutor", "PendingStep", "TensorParallelError", "UniProcExecutor",
           "make_executor"]
