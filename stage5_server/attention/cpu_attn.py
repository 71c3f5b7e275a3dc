"""Paged attention for a CPU: one call per layer for the decodes and one for the prefills.

stage2's torch reference loops over prefills in Python, copies K/V per query head for GQA and
writes K/V by advanced indexing; on a CPU those cost more than the math. This backend keeps its
KV layout and metadata, and: plans once per step (the blocks each sequence reads, the masks,
where each query row goes), not per layer; attends all the decodes in one call of a C++ operator
that reads each sequence's blocks in place (``cpu_kernels/``); and all the prefills
in one ``scaled_dot_product_attention`` over whole blocks gathered by ``index_select``, the query
heads that share a KV head folded into the query-length axis, so K/V is never copied. Where the
operator cannot be built, the decodes take the SDPA path too, as one more group.

Inside a compiled step (``model/compile.py``) a layer's attention is one operator: a step of decode
rows calls the C++ ``decode_step_attention``; any other step (prefill chunks beside decodes) calls
``paged_step_attention``, a custom operator (``torch.library``, with a fake kernel for the shapes)
that writes the step's K/V and runs the path above, its plan made by the first layer and reused by
the others while the step's metadata is the same.

vLLM: ``vllm/v1/attention/backends/cpu_attn.py`` (C++ kernels in ``csrc/cpu/``) and
``vllm/v1/attention/backends/flex_attention.py`` (a paged block mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stage2_paged.attention import PagedAttentionMetadata
from stage5_server.cpu_kernels.paged_decode import (
    cpu_decode_step_attention,
    cpu_paged_decode_attention,
    load_cpu_kernels,
)


@dataclass
class _Group:
    """A batch of sequences attended in one SDPA call."""

    blocks: torch.Tensor  # [B * num_blocks] int64: the cache blocks to gather, sequence after sequence
    num_blocks: int  # blocks per sequence (padded to the group's longest)
    mask: torch.Tensor  # [B, 1, group * Q | 1, num_blocks * block_size]: 0 where visible, -inf elsewhere
    query_rows: torch.Tensor  # [B * Q] int64: packed query row of each padded position (0 for padding)
    valid: torch.Tensor | None  # [B * Q] bool, None when every position is real (decodes)
    q_len: int  # Q: the group's longest query


@dataclass
class _InPlaceDecodes:
    """The step's decodes, for the C++ operator: it reads the block tables itself."""

    seq_index: torch.Tensor  # [B] int64: each decode's row of block_tables and seq_lens
    query_rows: torch.Tensor  # [B] int64: its query row
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


class CPUAttentionBackend:
    """Writes this step's K/V, then attends each group of sequences in one call."""

    def __init__(self, kv_cache, in_place_decodes: bool | None = None):
        self.kv_cache = kv_cache
        # None: the C++ operator where it builds (describe_attention_backend logs which path runs)
        self.in_place_decodes = load_cpu_kernels() is None if in_place_decodes is None else in_place_decodes
        self._plan_for: PagedAttentionMetadata | None = None
        self._plan: list[_Group | _InPlaceDecodes] = []

    def forward(self, layer_idx, query, key, value, meta: PagedAttentionMetadata, scale):
        if torch.compiler.is_compiling():  # a compiled step (model/compile.py): one operator per layer
            key_cache, value_cache = self.kv_cache.key[layer_idx], self.kv_cache.value[layer_idx]
            if meta.max_query_len == 1:  # decode rows
                return cpu_decode_step_attention(query, key, value, key_cache, value_cache, meta.slot_mapping,
                                                 meta.block_tables, meta.seq_lens, scale)
            return paged_step_attention(query, key, value, key_cache, value_cache, meta.slot_mapping,
                                        meta.query_start_loc, meta.seq_lens, meta.block_tables, scale)
        self.kv_cache.write(layer_idx, key, value, meta.slot_mapping)
        key_cache, value_cache = self.kv_cache.key[layer_idx], self.kv_cache.value[layer_idx]
        num_kv_heads = key_cache.shape[2]
        if meta is not self._plan_for:  # the first layer of a step
            self._plan = plan_groups(meta, key_cache.shape[1], query.shape[1] // num_kv_heads, query.dtype,
                                     self.in_place_decodes)
            self._plan_for = meta
        return grouped_paged_attention(query, key_cache, value_cache, self._plan, scale)


@torch.library.custom_op("stagedserve::paged_step_attention", mutates_args=("key_cache", "value_cache"))
def paged_step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer's attention for any step, as one operator a compiled graph holds: write each token's
    K/V at its slot (a negative slot is padding: not written), then attend as ``CPUAttentionBackend``."""
    written = slot_mapping >= 0
    if not bool(written.all()):
        key, value, slot_mapping = key[written], value[written], slot_mapping[written]
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)
    plan = _step_plan(query_start_loc, seq_lens, block_tables, key_cache.shape[1],
                      query.shape[1] // key_cache.shape[2], query.dtype)
    return grouped_paged_attention(query, key_cache, value_cache, plan, scale)


@paged_step_attention.register_fake
def _(query, key, value, key_cache, value_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale):
    return torch.empty_like(query)


_last_plan: tuple = ()  # (the metadata it was made for, copied; block size, group, dtype; the plan)


def _step_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
               group: int, dtype: torch.dtype) -> list[_Group | _InPlaceDecodes]:
    """``plan_groups`` for a step, made once: the layers after the first find it by the metadata's values."""
    global _last_plan
    if _last_plan and _last_plan[1] == (block_size, group, dtype) and all(
            torch.equal(a, b) for a, b in zip(_last_plan[0], (query_start_loc, seq_lens, block_tables))):
        return _last_plan[2]
    copies = (query_start_loc.clone(), seq_lens.clone(), block_tables.clone())  # the step's may be reused buffers
    meta = PagedAttentionMetadata(torch.empty(0, dtype=torch.long), *copies, max_query_len=0, max_seq_len=0)
    plan = plan_groups(meta, block_size, group, dtype, load_cpu_kernels() is None)
    _last_plan = (copies, (block_size, group, dtype), plan)
    return plan


def plan_groups(meta: PagedAttentionMetadata, block_size: int, group: int, dtype: torch.dtype,
                in_place_decodes: bool = False) -> list[_Group | _InPlaceDecodes]:
    """The step's decodes and prefills as (at most) two groups: padded for SDPA, or the decodes as
    they are for the C++ operator."""
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    prefills = [i for i, n in enumerate(q_lens) if n > 1]
    plan: list[_Group | _InPlaceDecodes] = []
    if decodes and in_place_decodes:
        plan.append(_InPlaceDecodes(torch.tensor(decodes), torch.tensor([starts[i] for i in decodes]),
                                    meta.block_tables, meta.seq_lens.contiguous()))
    elif decodes:
        plan.append(_plan_group(decodes, starts, q_lens, seq_lens, meta.block_tables, block_size, group, dtype))
    if prefills:
        plan.append(_plan_group(prefills, starts, q_lens, seq_lens, meta.block_tables, block_size, group, dtype))
    return plan


def _plan_group(rows, starts, q_lens, seq_lens, block_tables, block_size, group, dtype) -> _Group:
    num_blocks = -(-max(seq_lens[i] for i in rows) // block_size)
    index = torch.tensor(rows)
    blocks = block_tables[index, :num_blocks].long().flatten()
    key_pos = torch.arange(num_blocks * block_size)
    seq = torch.tensor([seq_lens[i] for i in rows])
    first = torch.tensor([starts[i] for i in rows])
    q_len = max(q_lens[i] for i in rows)
    if q_len == 1:
        visible = key_pos[None, :] < seq[:, None]  # [B, L]
        mask = _additive(visible, dtype)[:, None, None, :]
        return _Group(blocks, num_blocks, mask, first, None, 1)
    lens = torch.tensor([q_lens[i] for i in rows])
    offset = torch.arange(q_len)
    valid = offset[None, :] < lens[:, None]  # [B, Q]
    q_pos = (seq - lens)[:, None] + offset[None, :]  # absolute position of each query
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, :, None]  # [B, Q, L]
    visible[:, :, 0] |= ~valid  # a padding row sees one key, so its softmax stays finite
    mask = _additive(visible, dtype)[:, None].repeat(1, 1, group, 1)  # folded heads: group-major
    query_rows = torch.where(valid, first[:, None] + offset[None, :], 0).flatten()
    return _Group(blocks, num_blocks, mask, query_rows, valid.flatten(), q_len)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


def grouped_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            plan: list[_Group | _InPlaceDecodes], scale: float) -> torch.Tensor:
    """``query [T, H, D]`` over ``key_cache/value_cache [num_blocks, block_size, Hkv, D]``, as planned."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype)
    for g in plan:
        if isinstance(g, _InPlaceDecodes):
            cpu_paged_decode_attention(out, query, key_cache, value_cache, g.block_tables, g.seq_lens, g.seq_index,
                                       g.query_rows, scale)
            continue
        batch, length = g.blocks.numel() // g.num_blocks, g.num_blocks * block_size
        key = key_cache.index_select(0, g.blocks).view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
        value = value_cache.index_select(0, g.blocks).view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
        q = query.index_select(0, g.query_rows).view(batch, g.q_len, num_kv_heads, group, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * g.q_len, head_dim)
        o = F.scaled_dot_product_attention(q, key, value, attn_mask=g.mask, scale=scale)
        o = o.view(batch, num_kv_heads, group, g.q_len, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(batch * g.q_len, num_heads, head_dim)
        if g.valid is None:
            out.index_copy_(0, g.query_rows, o)
        else:
            out.index_copy_(0, g.query_rows[g.valid], o[g.valid])
    return out
