"""Paged attention in plain torch: the reference every later kernel is checked against.

K/V live in blocks of ``block_size`` token slots. A sequence's keys are found only through
its block table: logical block ``j`` of sequence ``i`` lives in physical block
``block_tables[i, j]``, so token position ``p`` is slot ``block_tables[i, p // B] * B + p % B``.
Nothing here assumes a sequence's blocks are adjacent or ordered in memory.

vLLM: the contract of ``vllm/v1/attention/backends/*`` (block tables + seq lens in the
attention metadata); the original CUDA kernel is ``csrc/attention/paged_attention_v1.cu``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.attention import causal_attention


@dataclass
class PagedAttentionMetadata:
    """What one step's attention needs, built by the model runner from the scheduler's output.

    Tokens of all sequences are packed back to back (no padding): sequence ``i`` owns query
    rows ``query_start_loc[i] : query_start_loc[i + 1]``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: the cache slot each new token's K/V goes to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step (context + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` token rows of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention for a ragged batch of prefills, prefill chunks and decodes.

    ``query [T, H, D]``; ``key_cache/value_cache [num_blocks, block_size, Hkv, D]`` already
    hold every token of every sequence, this step's included. Query row ``r`` of sequence
    ``i`` is at position ``seq_lens[i] - q_len_i + r`` and attends causally.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        out[rows] = _decode_attention(query[rows], key_cache, value_cache,
                                      block_tables[decodes], seq_lens[decodes], scale)
    for i in range(len(lens)):
        start, end = starts[i], starts[i + 1]
        if end - start <= 1:
            continue
        key = gather_kv(key_cache, block_tables[i], lens[i])
        value = gather_kv(value_cache, block_tables[i], lens[i])
        out[start:end] = causal_attention(query[start:end], key, value, scale)
    return out


def _decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """One query per sequence, all sequences at once: pad each context to the longest."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = block_tables[:, :max_blocks].long()
    key = key_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    value = value_cache[tables].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(key.shape[2], device=query.device)
    visible = positions[None, :] < seq_lens[:, None].to(positions.device)  # [B, L]: padding is masked out
    out = F.scaled_dot_product_attention(query.unsqueeze(2), key, value, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out.squeeze(2)


class PagedAttentionBackend:
    """Writes this step's K/V through the slot mapping, then runs ``paged_attention``."""

    def __init__(self, kv_cache):
        self.kv_cache = kv_cache

    def forward(self, layer_idx, query, key, value, meta: PagedAttentionMetadata, scale):
        self.kv_cache.write(layer_idx, key, value, meta.slot_mapping)
        return paged_attention(query, self.kv_cache.key[layer_idx], self.kv_cache.value[layer_idx],
                               meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)


def build_paged_metadata(slot_mapping: list[int], query_start_loc: list[int], seq_lens: list[int],
                         block_tables: list[list[int]], device) -> PagedAttentionMetadata:
    """Pack python lists from the scheduler into the tensors the attention reads."""
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    as_int = lambda xs, dtype=torch.int32: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    return PagedAttentionMetadata(
        slot_mapping=as_int(slot_mapping, torch.long), query_start_loc=as_int(query_start_loc),
        seq_lens=as_int(seq_lens), block_tables=as_int(padded),
        max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
        max_seq_len=max(seq_lens))
