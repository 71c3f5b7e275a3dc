"""``LLM`` for stage5: stage4's engine core on a chosen attention backend and device.

New here: the attention-backend registry (``attention/``: ``torch`` | ``triton``), CUDA as the
default device when present (bf16 weights), and a KV cache sized from free GPU memory after a
profiling forward pass (``gpu_memory_utilization``, ``attention/memory.py``) when no explicit
size is given. With ``tensor_parallel_size=N`` the model is split over N worker processes
(``parallel/``); this process keeps the scheduler and loads no weights.

vLLM: ``vllm/entrypoints/llm.py`` over ``vllm/v1/engine/llm_engine.py``; the backend choice is
``vllm/attention/selector.py``.
"""

from __future__ import annotations

import logging

import torch

from shared.config import ModelConfig
from shared.llm_base import kv_bytes_per_token
from stage4_prefix_cache.llm import LLM as _PrefixCachingLLM
from stage4_prefix_cache.llm import PREFIX_CACHING_ARGS
from stage5_server.attention import ATTENTION_BACKENDS, resolve_attention_backend
from stage5_server.attention.memory import profile_free_kv_memory, profiled_kv_memory
from stage5_server.parallel import build_tensor_parallel_engine, check_tensor_parallel_size

logger = logging.getLogger("stagedserve")

SERVER_ENGINE_ARGS = {**PREFIX_CACHING_ARGS, "attention_backend": None, "gpu_memory_utilization": 0.9,
                      "tensor_parallel_size": 1,
                      "distributed_interface": None}  # network interface of the ranks' traffic; None: loopback


class LLM(_PrefixCachingLLM):
    stage = "stage5_server"
    engine_args = SERVER_ENGINE_ARGS

    def default_device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _load_model(self):
        config = ModelConfig.from_pretrained(self.model_path)
        self.tensor_parallel_size = check_tensor_parallel_size(self.args["tensor_parallel_size"], config, self.device)
        if self.tensor_parallel_size == 1:
            return super()._load_model()
        return None, config  # the weights live in the workers

    def _build_engine(self):
        self.attention_backend_name = resolve_attention_backend(self.args["attention_backend"], self.device)
        logger.info("attention backend: %s (device %s)", self.attention_backend_name, self.device)
        if self.tensor_parallel_size > 1:
            return build_tensor_parallel_engine(
                self, lambda block_size, num_blocks: self._make_scheduler(self._cache_config(block_size, num_blocks)),
                self._stats_logger())
        engine = super()._build_engine()
        self.model.set_attention_backend(ATTENTION_BACKENDS[self.attention_backend_name](engine.kv_cache))
        return engine

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    def kv_cache_tokens(self) -> int:
        if self.args["kv_cache_memory"] is not None or self.device.type != "cuda":
            return super().kv_cache_tokens()
        memory = profiled_kv_memory(self.args, self.max_model_len,
                                    lambda n, u: profile_free_kv_memory(self.model, self.device, n, u))
        tokens = memory // kv_bytes_per_token(self.model_config, self.dtype)
        logger.info("KV cache sized from GPU memory: %.2f GiB -> %d tokens", memory / 2**30, tokens)
        return tokens


__all__ = ["LLM", "SERVER_ENGINE_ARGS"]
