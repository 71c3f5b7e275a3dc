"""Decode attention on a CPU that reads K/V in place: a small C++ operator, built on this machine.

``csrc/paged_decode.cpp`` registers ``torch.ops.stagedserve_cpu.paged_decode_attention``: for
each decoding sequence it walks the sequence's blocks through its block table, with no gather, no
padding to the batch's longest sequence and no mask. It is built with the other operators
(``build.py``); where it cannot be, the ``cpu`` backend keeps its SDPA path.

vLLM: ``csrc/cpu/attention.cpp`` (``paged_attention_v1``).
"""

from __future__ import annotations

import torch

from stage5_server.cpu_kernels.build import build_report, load_cpu_kernels

__all__ = ["build_report", "cpu_decode_step_attention", "cpu_paged_decode_attention", "load_cpu_kernels"]


def cpu_paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               seq_index: torch.Tensor, query_rows: torch.Tensor, scale: float) -> None:
    """Write ``out[query_rows[i]]``, the attention of query row ``query_rows[i]`` over the first
    ``seq_lens[seq_index[i]]`` tokens of the blocks ``block_tables[seq_index[i]]`` lists.
    ``query``/``out`` ``[T, H, D]``; caches ``[num_blocks, block_size, Hkv, D]``."""
    torch.ops.stagedserve_cpu.paged_decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                     seq_index, query_rows, scale)


def cpu_decode_step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode-only step's attention for one layer, in one operator (what a compiled step holds):
    write row ``i``'s ``key``/``value`` ``[T, Hkv, D]`` to cache slot ``slot_mapping[i]`` (a negative
    slot is padding, not written), then attend query row ``i`` over sequence ``i``: the first
    ``seq_lens[i]`` tokens of the blocks ``block_tables[i]`` lists. Returns ``[T, H, D]``."""
    return torch.ops.stagedserve_cpu.decode_step_attention(query, key, value, key_cache, value_cache, slot_mapping,
                                                           block_tables, seq_lens, scale)
