"""The engine core and how it is built: vLLM V1's chain, each layer entered once.

    EngineConfig (config.py)  ->  build_engine_core (builder.py)
    EngineCore(scheduler, executor) (engine_core.py): schedule -> execute -> update
      Scheduler (scheduler.py): stage 4's, plus draft tokens and the workers' view of a step
      Executor (executor/): UniProc | Multiproc -> Worker per rank -> ModelRunner (worker/)

vLLM: ``vllm/v1/engine/core.py``, ``vllm/v1/core/sched/``.
"""

from stage5_server.core.builder import build_engine_core
from stage5_server.core.engine_core import EngineCore
from stage5_server.core.scheduler import Scheduler, SchedulerOutput

__all__ = ["EngineCore", "Scheduler", "SchedulerOutput", "build_engine_core"]
