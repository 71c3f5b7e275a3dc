"""``LLM`` for stage5: stage4's engine core on a chosen attention backend and device.

New here: the backend registry (``torch`` | ``triton``), CUDA as the default device when
present (bf16 weights), and a KV cache sized from free GPU memory after a profiling
forward pass (``gpu_memory_utilization``, as vLLM's ``gpu_worker.py`` does) when no
explicit size is given. With ``tensor_parallel_size=N`` the model is split over N worker
processes (``stage5_server/parallel``); this process keeps the scheduler and loads no weights.
"""

from __future__ import annotations

import logging

import torch

from shared.config import ModelConfig
from shared.llm_base import DEFAULT_KV_CACHE_MEMORY, kv_bytes_per_token
from stage4_prefix_cache.llm import LLM as _PrefixCachingLLM
from stage4_prefix_cache.llm import PREFIX_CACHING_ARGS
from stage5_server.attention_backends import ATTENTION_BACKENDS, resolve_attention_backend
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
        if self.tensor_parallel_size == 1:
            return super()._build_engine()
        return build_tensor_parallel_engine(self)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

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
        num_tokens = min(self.args["max_num_batched_tokens"], self.max_model_len)
        memory = profile_free_kv_memory(self.model, self.device, num_tokens, utilization)
        tokens = memory // kv_bytes_per_token(self.model_config, self.dtype)
        logger.info("KV cache sized from GPU memory: %.2f GiB -> %d tokens", memory / 2**30, tokens)
        return tokens


def profile_free_kv_memory(model, device: torch.device, num_tokens: int, utilization: float) -> int:
    """Run one forward of ``num_tokens`` tokens without a KV cache and give the KV cache what
    is left of ``utilization * total`` after its peak."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model.set_attention_backend(_NoCacheAttention())
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), None)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    other_processes = total - free - torch.cuda.memory_reserved(device)
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
