"""``LLM`` for stage5: stage4's engine core on a chosen attention backend and device.

New here: the attention-backend registry (``attention/``), CUDA by default when present (bf16),
a KV cache sized from free GPU memory (``attention/memory.py``), a step's inputs gathered from a
persistent input batch (``worker/``), the model rearranged for speed (``model/``), one torch
thread per physical core on a CPU (``engine/cpu_threads.py``) with ``dtype="auto"`` bfloat16
where it wins, and ``tensor_parallel_size=N`` (``parallel/``).

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
from stage5_server.engine.cpu_threads import configure_engine_threads
from stage5_server.model import compile_model, fuse_projections
from stage5_server.parallel import build_tensor_parallel_engine, check_tensor_parallel_size
from stage5_server.worker import PersistentBatchEngineCore

logger = logging.getLogger("stagedserve")

SERVER_ENGINE_ARGS = {**PREFIX_CACHING_ARGS, "attention_backend": None, "gpu_memory_utilization": 0.9,
                      "tensor_parallel_size": 1,
                      "distributed_interface": None,  # network interface of the ranks' traffic; None: loopback
                      "enforce_eager": None,  # None: eager (compiling was not measured faster); False: torch.compile
                      "cpu_threads": None}  # torch threads on a CPU; None: one per physical core
# bfloat16 pays on a CPU with native bf16 (AMX, AVX512-BF16) once the GEMMs are wide enough:
# measured faster than float32 from SmolLM2-135M's hidden 576 up, slower for the random
# checkpoints of hidden 128 and 256 (oneDNN's per-call cost dominates there; performance page).
CPU_BF16_MIN_HIDDEN_SIZE = 512


def cpu_has_native_bf16() -> bool:
    """AMX tiles or AVX512-BF16: bfloat16 matrix multiplies in hardware."""
    cpu = getattr(torch, "cpu", None)
    return bool(cpu and (getattr(cpu, "_is_amx_tile_supported", lambda: False)()
                         or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()))


def cpu_auto_dtype(config: ModelConfig) -> torch.dtype:
    """What ``dtype="auto"`` means on a CPU for this model."""
    if cpu_has_native_bf16() and config.hidden_size >= CPU_BF16_MIN_HIDDEN_SIZE:
        return torch.bfloat16
    return torch.float32


class LLM(_PrefixCachingLLM):
    stage = "stage5_server"
    engine_args = SERVER_ENGINE_ARGS
    engine_core_class = PersistentBatchEngineCore

    def default_device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _resolve_dtype(self, dtype):
        if dtype == "auto" and self.device.type == "cpu":
            return cpu_auto_dtype(ModelConfig.from_pretrained(self.model_path))
        return super()._resolve_dtype(dtype)

    def _load_model(self):
        config = ModelConfig.from_pretrained(self.model_path)
        self.tensor_parallel_size = check_tensor_parallel_size(self.args["tensor_parallel_size"], config, self.device)
        if self.args["enforce_eager"] not in (None, True, False):
            raise ValueError(f"enforce_eager: must be a bool, got {self.args['enforce_eager']!r}")
        if self.device.type == "cpu" and self.tensor_parallel_size == 1:
            configure_engine_threads(self.args["cpu_threads"])  # the ranks of a split model share the cores
        if self.tensor_parallel_size == 1:
            model, config = super()._load_model()
            return fuse_projections(model, step_rope=self.args["enforce_eager"] is not False), config
        return None, config  # the weights live in the workers

    def _build_engine(self):
        self.attention_backend_name = resolve_attention_backend(self.args["attention_backend"], self.device)
        logger.info("attention backend: %s (device %s)", self.attention_backend_name, self.device)
        if self.tensor_parallel_size > 1:
            return build_tensor_parallel_engine(
                self, lambda block_size, num_blocks: self._make_scheduler(self._cache_config(block_size, num_blocks)),
                self._stats_logger())
        engine = super()._build_engine()
        backend = ATTENTION_BACKENDS[self.attention_backend_name](engine.kv_cache)
        if self.args["enforce_eager"] is False:
            compile_model(self.model, backend)
        else:
            self.model.set_attention_backend(backend)
        return engine

    def _make_requests(self, prompt, params, *args, **kwargs):
        if self.tensor_parallel_size > 1 and getattr(params, "prompt_logprobs", None) is not None:
            # The ranks send back only the logits of each request's last position.
            raise ValueError("prompt_logprobs: not available with tensor_parallel_size > 1")
        return super()._make_requests(prompt, params, *args, **kwargs)

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
