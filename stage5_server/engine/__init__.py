"""The async engine: a front end that speaks asyncio, over an engine core that steps on its own.

The two halves talk only in typed messages (``messages.py``). The front end
(``frontend.AsyncEngine``) checks and tokenizes requests (``input_processor.py``), turns the core's
outputs into text, finds stop strings (``shared/output_processor.py``) and streams ``RequestOutput``s.
The core (stage 4's) is driven by one busy loop (``core_loop.py``) on a thread (``AsyncLLM``) or
in a process over ZeroMQ (``MPAsyncLLM``, ``core_proc.py``): the same loop and messages, so both
modes give the same tokens. Data
parallelism: N core processes (``launcher.py``), a coordinator, and per API server a front end
routing each request to a rank (``dp_client.DPAsyncLLM``, ``routing.py``).

vLLM: ``vllm/v1/engine/`` (``async_llm.py``, ``core_client.py``, ``core.py``,
``input_processor.py``, ``output_processor.py``, ``exceptions.py``, ``coordinator.py``, ``utils.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that what needs only ``errors`` (tensor parallelism, ``LLM``) does not
# load the front end, msgspec or pyzmq.
_EXPORTS = {
    "AsyncEngine": "frontend", "StatLogger": "frontend", "RequestStream": "stream", "AsyncLLM": "thread_client",
    "MPAsyncLLM": "process_client", "DPAsyncLLM": "dp_client", "EngineError": "errors",
    "EngineDeadError": "errors", "RequestAborted": "errors", "InputProcessor": "input_processor",
}


def make_async_llm(model: str | None = None, *, engine_process: bool = False, data_parallel_size: int = 1,
                   dp_routing: str = "least-loaded", log_stats_interval: float | None = 10.0, **engine_args: Any):
    """An async engine over stage5's ``LLM``: its core in a child process (``engine_process``), N cores
    behind a coordinator (``data_parallel_size``; ``DPAsyncLLM``), or on a thread here (the default)."""
    if data_parallel_size != 1:
        from stage5_server.engine.dp_client import DPAsyncLLM

        return DPAsyncLLM.launch(model, data_parallel_size=data_parallel_size, routing=dp_routing,
                                 log_stats_interval=log_stats_interval, **engine_args)
    if engine_process:
        from stage5_server.engine.process_client import MPAsyncLLM

        return MPAsyncLLM(model, log_stats_interval=log_stats_interval, **engine_args)
    from stage5_server.engine.thread_client import AsyncLLM
    from stage5_server.llm import LLM

    return AsyncLLM(LLM(model=model, **engine_args), log_stats_interval=log_stats_interval)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = [*_EXPORTS, "make_async_llm"]
