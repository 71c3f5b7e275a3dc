"""The one-device executor: a single worker, in the engine core's own process.

Its calls are plain method calls; the worker is the same one a tensor-parallel rank runs.

vLLM: ``UniProcExecutor`` in ``vllm/v1/executor/uniproc_executor.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from stage5_server.config import EngineConfig
from stage5_server.pooling.worker import make_worker
from stage5_server.worker import ModelRunnerInput, ModelRunnerOutput


class DoneStep:
    def __init__(self, output: ModelRunnerOutput):
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class UniProcExecutor:
    world_size = 1

    def __init__(self, config: EngineConfig):
        self.driver_worker = make_worker(config)  # the generating worker, or a pooling one

    def collective_rpc(self, method: str | Callable, *args) -> list:
        """``method(*args)`` on the worker (a function: ``method(worker, *args)``), as a one-element list."""
        worker = self.driver_worker
        return [getattr(worker, method)(*args) if isinstance(method, str) else method(worker, *args)]

    def execute_model(self, step: ModelRunnerInput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(step)

    def execute_model_async(self, step: ModelRunnerInput) -> DoneStep:
        """The step, already run (one process has nothing to overlap it with)."""
        return DoneStep(self.execute_model(step))

    def shutdown(self) -> None:
        pass
