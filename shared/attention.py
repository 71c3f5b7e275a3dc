"""Causal attention over one sequence's keys: the math every KV layout shares.

Each stage stores K/V differently (one slab, paged blocks, a Triton kernel), but once a
sequence's keys and values are gathered into contiguous tensors the computation is the
same. Query row ``i`` sits at absolute position ``num_keys - num_queries + i`` and may
attend to keys ``0 .. that position``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``query [Tq, H, D]`` over ``key/value [Tk, Hkv, D]`` with Tq <= Tk.

    Grouped-query attention: ``H`` query heads share ``Hkv`` KV heads (H % Hkv == 0).
    Returns ``[Tq, H, D]`` in the query's dtype; softmax runs in float32.
    """
    num_queries, num_heads, _ = query.shape
    num_keys, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.transpose(0, 1).float()  # [H, Tq, D]
    k = key.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [H, Tk, D]
    v = value.transpose(0, 1).float().repeat_interleave(group, dim=0)
    if num_queries == 1:
        mask = None  # a single newest query sees every key
    else:
        q_pos = torch.arange(num_keys - num_queries, num_keys, device=query.device)
        k_pos = torch.arange(num_keys, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(query.dtype)
