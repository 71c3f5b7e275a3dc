"""``LLM`` for stage2: block-sized KV, same static batching."""

from __future__ import annotations

import logging

from shared.llm_base import BaseLLM
from stage2_paged.block_table import BlockAllocator
from stage2_paged.engine import PagedEngineCore
from stage2_paged.kv_cache import PagedKVCache

logger = logging.getLogger("stagedserve")

PAGED_ARGS = {
    "block_size": 16,
    "num_kv_blocks": None,  # else derived from kv_cache_memory
    "block_shuffle_seed": None,  # shuffle the free list (physical order must not matter)
}


def resolve_num_blocks(llm: BaseLLM) -> tuple[int, int]:
    """(block_size, num_blocks) from the engine arguments, checked."""
    block_size = check_block_size(llm.args["block_size"])
    num_blocks = llm.args["num_kv_blocks"] or llm.kv_cache_tokens() // block_size
    check_pool_holds_one_sequence(llm, num_blocks, block_size)
    logger.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, block_size, num_blocks * block_size)
    return block_size, num_blocks


def check_block_size(block_size) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
    return block_size


def check_num_blocks(num_blocks) -> int:
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ValueError(f"num_kv_blocks: must be a positive integer, got {num_blocks!r}")
    return num_blocks


def check_pool_holds_one_sequence(llm: BaseLLM, num_blocks, block_size: int) -> None:
    """A pool smaller than one ``max_model_len`` sequence could never finish that sequence: refused,
    unless neither was set by the user, when ``max_model_len`` comes down to the pool
    (``BaseLLM.set_kv_cache_capacity``)."""
    check_num_blocks(num_blocks)
    llm.set_kv_cache_capacity(num_blocks * block_size, "num_kv_blocks",
                              pool_too_small(num_blocks, block_size, llm.max_model_len))


def pool_too_small(num_blocks: int, block_size: int, max_model_len: int) -> str:
    return (f"num_kv_blocks: {num_blocks} blocks of {block_size} tokens cannot hold one "
            f"max_model_len={max_model_len} sequence; lower max_model_len or add blocks")


def make_paged_cache(llm: BaseLLM, block_size: int, num_blocks: int) -> PagedKVCache:
    cfg = llm.model_config
    return PagedKVCache(num_blocks, block_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                        llm.dtype, llm.device)


class LLM(BaseLLM):
    stage = "stage2_paged"
    engine_args = PAGED_ARGS

    def _build_engine(self) -> PagedEngineCore:
        block_size, num_blocks = resolve_num_blocks(self)
        allocator = BlockAllocator(num_blocks, self.args["block_shuffle_seed"])
        return PagedEngineCore(self.model, make_paged_cache(self, block_size, num_blocks), allocator,
                               self.args["max_num_seqs"], self.max_model_len, self.device, self.args["seed"])
