"""The async engine's front end: it speaks asyncio, over an engine core that steps on its own.

``frontend.AsyncEngine`` checks and tokenizes requests (``input_processor.py``), sends them to the
core as ``core/messages.py`` Structs, turns the core's outputs into text, finds stop strings
(``output_processor.py``) and streams ``RequestOutput``s (``stream.py``). Where the core
runs is the client's business: on a thread of this process (``thread_client.AsyncLLM``), or in
processes of their own over ZeroMQ (``mp_client.MPAsyncLLM``: one engine core, or N behind a
coordinator, ``data_parallel/``). The core's side, the same loop in both, is ``core/busy_loop.py``.

vLLM: ``vllm/v1/engine/`` (``async_llm.py``, ``core_client.py``, ``input_processor.py``,
``output_processor.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that importing one name does not load the front end, msgspec or pyzmq.
_EXPORTS = {
    "AsyncEngine": "engine.frontend", "StatLoggerBase": "engine.frontend", "RequestStream": "engine.stream",
    "AsyncLLM": "engine.thread_client", "MPAsyncLLM": "engine.mp_client", "InputProcessor": "engine.input_processor",
    "OutputProcessor": "engine.output_processor", "RequestOutputKind": "engine.output_processor",
    "EngineError": "errors", "EngineDeadError": "errors", "RequestAborted": "errors",
}


def make_async_llm(model: str | None = None, *, engine_process: bool = False, data_parallel_size: int = 1,
                   dp_routing: str = "least-loaded", log_stats_interval: float | None = 10.0, **engine_args: Any):
    """An async engine over stage5's engine core: in a child process (``engine_process``), N cores behind
    a coordinator (``data_parallel_size``), both ``MPAsyncLLM``; or on a thread here (the default)."""
    if engine_process or data_parallel_size != 1:
        from stage5_server.engine.mp_client import MPAsyncLLM

        return MPAsyncLLM(model, data_parallel_size=data_parallel_size, routing=dp_routing,
                          log_stats_interval=log_stats_interval, **engine_args)
    from stage5_server.config import EngineConfig
    from stage5_server.engine.thread_client import AsyncLLM

    return AsyncLLM.from_config(EngineConfig.create(model, **engine_args), log_stats_interval=log_stats_interval)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"stage5_server.{_EXPORTS[name]}"), name)


__all__ = [*_EXPORTS, "make_async_llm"]
