"""The engine core and how it is built: vLLM V1's chain, each layer entered once.

    EngineConfig (config.py)  ->  build_engine_core (builder.py)
    EngineCore(scheduler, executor, drafter) (engine_core.py): schedule -> execute -> update
      Scheduler (scheduler.py): stage 4's, describing each step for the workers (``stage5_server/outputs.py``)
        and making the front end's outputs (messages.py)
      Executor (executor/): UniProc | Multiproc | Ray -> Worker per rank -> ModelRunner (worker/)

vLLM: ``vllm/v1/engine/core.py``, ``vllm/v1/core/sched/``.
"""

from stage5_server.core.builder import build_engine_core
from stage5_server.core.engine_core import EngineCore
from stage5_server.core.scheduler import Scheduler
from stage5_server.outputs import SchedulerOutput

__all__ = ["EngineCore", "Scheduler", "SchedulerOutput", "build_engine_core"]
