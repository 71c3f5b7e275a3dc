"""``LLM`` for stage5: stage4's engine core on a chosen attention backend and device.

New here: the backend registry (``torch`` | ``triton``), CUDA as the default device when
present (bf16 weights), and a KV cache sized from free GPU memory after a profiling
forward pass (``gpu_memory_utilization``, as vLLM's ``gpu_worker.py`` does) when no
explicit size is given.
"""

from __future__ import annotations

import logging

import torch

from shared.llm_base import DEFAULT_KV_CACHE_MEMORY, kv_bytes_per_token
from stage4_prefix_cache.llm import LLM as _PrefixCachingLLM
from stage4_prefix_cache.llm import PREFIX_CACHING_ARGS
from stage5_server.attention_backends import ATTENTION_BACKENDS, resolve_attention_backend

logger = logging.getLogger("stagedserve")

SERVER_ENGINE_ARGS = {**PREFIX_CACHING_ARGS, "attention_backend": None, "gpu_memory_utilization": 0.9}


class LLM(_PrefixCachingLLM):
    stage = "stage5_server"
    engine_args = SERVER_ENGINE_ARGS

    def default_device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _attention_backend(self, kv_cache):
        name = resolve_attention_backend(self.args["attention_backend"], self.device)
        self.attention_backend_name = name
        logger.info("attention backend: %s (device %s)", name, self.device)
        return ATTENTION_BACKENDS[name](kv_cache)

    def kv_cache_tokens(self) -> int:
        explicit = self.args["kv_cache_memory"]
        if explicit is not None or self.device.type != "cuda":
            return super().kv_cache_tokens()
        utilization = self.args["gpu_memory_utilization"]
        if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization!r}")
        memory = self._profile_free_kv_memory(utilization)
        tokens = memory // kv_bytes_per_token(self.model_config, self.dtype)
        logger.info("KV cache sized from GPU memory: %.2f GiB -> %d tokens", memory / 2**30, tokens)
        return tokens

    def _profile_free_kv_memory(self, utilization: float) -> int:
        """Run one forward of ``max_num_batched_tokens`` tokens without a KV cache and
        give the KV cache what is left of ``utilization * total`` after its peak."""
        num_tokens = min(self.args["max_num_batched_tokens"], self.max_model_len)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model.set_attention_backend(_NoCacheAttention())
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), None)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        other_processes = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * utilization) - peak - max(0, other_processes)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization: {utilization} leaves no memory for the KV cache "
                             f"(weights and activations peak at {peak / 2**30:.2f} GiB)")
        return budget


class _NoCacheAttention:
    """Causal attention over the profiling batch itself (one sequence, nothing stored)."""

    def forward(self, layer_idx, query, key, value, attn_metadata, scale):
        from shared.attention import causal_attention

        return causal_attention(query, key, value, scale)


__all__ = ["LLM", "SERVER_ENGINE_ARGS", "DEFAULT_KV_CACHE_MEMORY"]
