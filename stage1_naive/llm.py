"""``LLM`` for stage1: the shared front end over the static-batching engine."""

from __future__ import annotations

import logging

from shared.llm_base import BaseLLM
from stage1_naive.engine import NaiveEngineCore
from stage1_naive.kv_cache import ContiguousKVCache

logger = logging.getLogger("stagedserve")


class LLM(BaseLLM):
    stage = "stage1_naive"
    engine_args = {"num_kv_slots": None}  # slab size in tokens; else derived from kv_cache_memory

    def _build_engine(self) -> NaiveEngineCore:
        num_slots = self.args["num_kv_slots"] or self.kv_cache_tokens()
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_kv_slots: must be a positive integer, got {num_slots!r}")
        self.set_kv_cache_capacity(num_slots, "num_kv_slots", f"num_kv_slots: the slab ({num_slots}) must hold "
                                   f"one max_model_len reservation ({self.max_model_len})")
        cfg = self.model_config
        cache = ContiguousKVCache(num_slots, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                  self.dtype, self.device)
        logger.info("stage1 slab: %d slots, %d reservations of %d", num_slots,
                    num_slots // self.max_model_len, self.max_model_len)
        return NaiveEngineCore(self.model, cache, self.args["max_num_seqs"], self.max_model_len,
                               self.device, self.args["seed"])
