"""Stage 5: the deployable server. Attention runs in kernels chosen by a backend registry, the
engine core steps on its own (on a thread, or in a process of its own), and a secured
OpenAI-compatible HTTP server streams its results.

The engine core is stage 4's, imported; stage 5 adds rooms around it, one idea each:
``attention/`` (the backend registry, the Triton kernels, KV sizing; ``vllm/v1/attention/``),
``engine/`` (the async engine on a thread or over ZeroMQ; ``vllm/v1/engine/``), ``server/``
(the OpenAI-compatible app, keys and trust groups, metrics; ``vllm/entrypoints/openai/``),
``parallel/`` (tensor parallelism; ``vllm/distributed/``), ``cli/`` and ``bench/`` (the
``stagedserve`` command and its load benchmark; ``vllm/entrypoints/cli/``, ``vllm/benchmarks/``).

Everything but ``LLM`` is imported on first use, so ``from stage5_server import LLM`` loads
neither fastapi nor pyzmq nor msgspec.
"""

from __future__ import annotations

import importlib

from stage4_prefix_cache import *  # noqa: F403  (re-export the whole surface of the stage before)
from stage4_prefix_cache import __all__ as _stage4_all
from stage5_server.llm import LLM

_EXPORTS = {
    "ATTENTION_BACKENDS": "stage5_server.attention", "TritonAttentionBackend": "stage5_server.attention",
    "resolve_attention_backend": "stage5_server.attention",
    "AsyncEngine": "stage5_server.engine", "AsyncLLM": "stage5_server.engine", "MPAsyncLLM": "stage5_server.engine",
    "make_async_llm": "stage5_server.engine", "EngineError": "stage5_server.engine",
    "EngineDeadError": "stage5_server.engine", "RequestAborted": "stage5_server.engine",
    "create_app": "stage5_server.server", "ServerThread": "stage5_server.server",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [n for n in _stage4_all if n != "LLM"] + ["LLM", *_EXPORTS]
