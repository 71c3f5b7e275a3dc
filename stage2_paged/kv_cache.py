"""The paged K/V tensors: per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``.

This is the layout a GPU kernel reads (stage5's Triton kernels take exactly these
tensors). Writes go through a slot mapping, one flat slot index per new token. On CPU the
tensors are anonymous memory maps (``shared.host_memory.kv_zeros``): RAM backs the blocks
that have been written, not the whole pool.
vLLM: the KV tensors allocated in ``vllm/v1/worker/gpu_model_runner.py``
(``initialize_kv_cache``) and written by ``reshape_and_cache``.
"""

from __future__ import annotations

import torch

from shared.host_memory import kv_zeros


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key = [kv_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.value = [kv_zeros(shape, dtype, device) for _ in range(num_layers)]

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key/value [num_tokens, Hkv, D]`` at their flat slots.

        ``index_copy_`` rather than ``cache[slots] = key``: the same write, but advanced-index
        assignment takes a general path that is about 100x slower on a CPU."""
        self.key[layer_idx].view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
        self.value[layer_idx].view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)
