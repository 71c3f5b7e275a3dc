"""Stage 5: the deployable server. Attention runs in Triton kernels chosen by a backend
registry, the engine core runs off the event loop, and a secured OpenAI-compatible HTTP
server streams its results.

New here: ``attention_backends`` (``torch`` | ``triton``) and ``kernels/`` (paged attention
that reads K/V through block tables on the GPU), ``AsyncLLM`` (the step loop on a
background thread, one async stream per request) or ``MPAsyncLLM`` (the engine core in a
process of its own, over ZeroMQ), ``create_app`` (routes, API keys on
every route, trust-group cache salts, Prometheus metrics), the ``stagedserve`` CLI and its
benchmarks. The engine core is stage4's, imported. vLLM: ``vllm/v1/engine/async_llm.py``,
``vllm/entrypoints/openai/api_server.py``, ``vllm/attention/ops/`` (Triton kernels),
``vllm/v1/metrics/loggers.py``.
"""

from stage4_prefix_cache import *  # noqa: F403  (re-export the whole surface of the stage before)
from stage4_prefix_cache import __all__ as _stage4_all
from stage5_server.api_server import create_app
from stage5_server.async_llm import AsyncLLM
from stage5_server.attention_backends import ATTENTION_BACKENDS, TritonAttentionBackend, resolve_attention_backend
from stage5_server.core_client import MPAsyncLLM, make_async_llm
from stage5_server.llm import LLM

__all__ = [n for n in _stage4_all if n != "LLM"] + [
    "LLM", "ATTENTION_BACKENDS", "AsyncLLM", "MPAsyncLLM", "TritonAttentionBackend", "create_app",
    "make_async_llm", "resolve_attention_backend",
]
