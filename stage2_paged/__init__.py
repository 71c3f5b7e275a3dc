"""Stage 2: paged KV. K/V live in fixed-size blocks found through per-request block tables.

The one new idea is PagedAttention's memory layout: blocks are allocated as a sequence
grows and returned when it ends, so waste is at most one partial block per sequence
instead of a whole ``max_model_len`` reservation. Changed from stage1: the KV cache,
the attention (it reads K/V through block tables) and admission (counts blocks); the
static-batching loop is stage1's, imported. vLLM: ``vllm/v1/core/block_pool.py``,
``vllm/v1/worker/block_table.py``, and the paged-attention kernels in ``csrc/attention/``.
"""

from stage1_naive import *  # noqa: F403  (re-export the whole surface of the stage before)
from stage1_naive import __all__ as _stage1_all
from stage2_paged.attention import (
    PagedAttentionBackend,
    PagedAttentionMetadata,
    build_paged_metadata,
    gather_kv,
    paged_attention,
)
from stage2_paged.block_table import BlockAllocator, BlockTable, OutOfBlocksError, slot_mapping
from stage2_paged.engine import PagedEngineCore
from stage2_paged.kv_cache import PagedKVCache

# ``LLM`` (``llm.py``) loads on first use (``__getattr__`` below): importing the stage loads its engine alone. It is in
# no ``__all__``, so the next stage's ``import *`` takes the rest of the surface and gives its own ``LLM``.
__all__ = _stage1_all + [
    "BlockAllocator", "BlockTable", "OutOfBlocksError", "PagedKVCache", "PagedAttentionBackend",
    "PagedAttentionMetadata", "PagedEngineCore", "build_paged_metadata", "gather_kv", "paged_attention",
    "slot_mapping",
]


def __getattr__(name: str):
    if name == "LLM":  # the offline front end over this stage's engine (``llm.py``), loaded on first use
        from stage2_paged.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
