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

from stage5_server.executor.abstract import DoneStep, Executor, PendingStep, make_executor, make_worker

__all__ = ["DoneStep", "Executor", "PendingStep", "make_executor", "make_worker"]
