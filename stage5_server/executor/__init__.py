"""Executors: where the workers live. The engine core calls ``execute_model`` and ``collective_rpc``
and cannot tell which one it has.

- ``UniProcExecutor`` (``uniproc.py``): one worker in the engine core's process;
- ``MultiprocExecutor`` (``multiproc.py``): one worker process per tensor-parallel rank.

vLLM: ``vllm/v1/executor/abstract.py`` (``Executor.get_class``), ``uniproc_executor.py``,
``multiproc_executor.py``.
"""

from __future__ import annotations

from stage5_server.config import EngineConfig
from stage5_server.executor.multiproc import MultiprocExecutor, TensorParallelError
from stage5_server.executor.uniproc import UniProcExecutor

Executor = UniProcExecutor | MultiprocExecutor


def make_executor(config: EngineConfig) -> Executor:
    """The executor for ``config``: one worker process per rank when the model is split, else this process."""
    if config.parallel.tensor_parallel_size > 1:
        return MultiprocExecutor(config)
    return UniProcExecutor(config)


__all__ = ["Executor", "MultiprocExecutor", "TensorParallelError", "UniProcExecutor", "make_executor"]
