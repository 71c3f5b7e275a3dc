"""The one-device executor: a single worker, in the engine core's own process.

Its calls are plain method calls; the worker is the same one a tensor-parallel rank runs.

vLLM: ``UniProcExecutor`` in ``vllm/v1/executor/uniproc_executor.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stage5_server.executor.abstract import DoneStep, Executor, call, make_worker

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig
    from stage5_server.outputs import SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.driver_worker = make_worker(config)  # the thread count is the engine's own (core/cpu_threads.py)

    def collective_rpc(self, method: str | Callable, *args: Any) -> list:
        return [call(self.driver_worker, method, args)]

    def execute_model_async(self, step: SchedulerOutput) -> DoneStep:
        return DoneStep(self.driver_worker.execute_model(step))

    def shutdown(self) -> None:
        self.driver_worker.shutdown()  # its sockets, if a KV connector opened any
