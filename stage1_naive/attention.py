"""Attention over the slab: a sequence's keys are the slots ``start .. start + seq_len``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.attention import causal_attention
from stage1_naive.kv_cache import ContiguousKVCache


@dataclass
class ContiguousAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: slab slot of each new token (start + position)
    query_start_loc: list[int]
    seq_lens: list[int]
    seq_starts: list[int]  # first slab slot of each sequence's reservation


class ContiguousAttentionBackend:
    def __init__(self, kv_cache: ContiguousKVCache):
        self.kv_cache = kv_cache

    def forward(self, layer_idx, query, key, value, meta: ContiguousAttentionMetadata, scale):
        key_slab, value_slab = self.kv_cache.key[layer_idx], self.kv_cache.value[layer_idx]
        key_slab[meta.slot_mapping] = key
        value_slab[meta.slot_mapping] = value
        out = torch.empty_like(query)
        for i, (start, seq_len) in enumerate(zip(meta.seq_starts, meta.seq_lens)):
            rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
            keys = slice(start, start + seq_len)
            out[rows] = causal_attention(query[rows], key_slab[keys], value_slab[keys], scale)
        return out
