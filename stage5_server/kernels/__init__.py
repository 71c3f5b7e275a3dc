"""stage5's GPU kernels, in Triton: today the paged-attention kernels behind the ``triton``
attention backend (``attention/triton_backend.py``); GEMM kernels will live here too.

``reshape_and_cache`` writes a step's new K/V into their cache slots; ``triton_paged_attention``
is a drop-in for stage2's torch ``paged_attention`` that reads K/V straight through the block
tables, with a split-K decode kernel (``paged_decode_attention``) and a causal kernel for
prefills, prefill chunks and mixed batches (``paged_prefill_attention``). To run them on CPU
tensors (slowly, for tests), set ``TRITON_INTERPRET=1`` before importing this package.

vLLM: ``vllm/attention/ops/triton_reshape_and_cache_flash.py``,
``vllm/attention/ops/triton_decode_attention.py``, ``vllm/attention/ops/triton_unified_attention.py``.
"""

from stage5_server.kernels.paged_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    triton_paged_attention,
)
from stage5_server.kernels.reshape_and_cache import reshape_and_cache

__all__ = [
    "choose_num_splits",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "triton_paged_attention",
]
