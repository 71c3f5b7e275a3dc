"""Stage 5: the deployable server. Attention runs in kernels chosen by a backend registry, the
engine core steps on its own (on a thread, or in a process of its own), and a secured
OpenAI-compatible HTTP server streams its results.

Stage 4's scheduler and KV cache manager run inside vLLM V1's chain: ``config/``
(``EngineConfig``, every argument checked once), ``core/`` (``build_engine_core``, ``EngineCore``,
the scheduler with draft tokens; ``vllm/v1/engine/core.py``), ``executor/`` and ``worker/`` (where
the workers live, and each rank's ``Worker``, ``ModelRunner`` and ``InputBatch``;
``vllm/v1/executor/``, ``vllm/v1/worker/``). Around it, one idea a room: ``attention/`` (the
backend registry, KV sizing; ``vllm/v1/attention/``), ``kernels/`` (the Triton kernels),
``model/`` (the model rearranged for speed), ``engine/`` (the async engine on a thread or over
ZeroMQ; ``vllm/v1/engine/``), ``server/`` (the OpenAI-compatible app, keys and trust groups,
metrics; ``vllm/entrypoints/openai/``), ``lora/`` (LoRA adapters side by side; ``vllm/lora/``),
``parallel/`` (tensor parallelism; ``vllm/distributed/``),
``cli/`` and ``bench/`` (the ``stagedserve`` command and its load benchmark;
``vllm/entrypoints/cli/``, ``vllm/benchmarks/``).

Importing the package loads the engine core and its configuration; everything else, ``LLM`` included, is
imported on first use, so ``from stage5_server import LLM`` loads neither fastapi nor pyzmq.
"""

from __future__ import annotations

import importlib

from stage4_prefix_cache import *  # noqa: F403  (re-export the whole surface of the stage before)
from stage4_prefix_cache import __all__ as _stage4_all
from stage5_server.config import EngineConfig  # noqa: F401  (in __all__ below)
from stage5_server.core import EngineCore, Scheduler, SchedulerOutput, build_engine_core  # noqa: F401
from stage5_server.core.request import Request  # noqa: F401

_EXPORTS = {
    "LLM": "stage5_server.llm",  # the offline front end, on first use (the next line's names likewise)
    "ATTENTION_BACKENDS": "stage5_server.attention", "TritonAttentionBackend": "stage5_server.attention",
    "resolve_attention_backend": "stage5_server.attention",
    "AsyncEngine": "stage5_server.engine", "AsyncLLM": "stage5_server.engine", "MPAsyncLLM": "stage5_server.engine",
    "make_async_llm": "stage5_server.engine", "EngineError": "stage5_server.engine",
    "EngineDeadError": "stage5_server.engine", "RequestAborted": "stage5_server.engine",
    "LoRARequest": "stage5_server.lora",
    "create_app": "stage5_server.server", "ServerThread": "stage5_server.server",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


_OWN = ["EngineConfig", "EngineCore", "Request", "Scheduler", "SchedulerOutput", "build_engine_core"]
__all__ = [n for n in _stage4_all if n not in _OWN] + _OWN + [n for n in _EXPORTS if n != "LLM"]  # LLM: as stage 4's
