"""CPU KV memory: what is free, and zeroed KV tensors that take RAM only where they are written."""

from __future__ import annotations

import psutil
import torch

from shared.host_memory import available_memory, kv_zeros


def test_available_memory_is_positive_and_at_most_the_machine():
    free = available_memory()
    assert 0 < free <= psutil.virtual_memory().total


def test_kv_zeros_reads_zero_and_takes_memory_only_where_written():
    process = psutil.Process()
    before = process.memory_info().rss
    pool = kv_zeros((4096, 16, 8, 64), torch.float32)  # 128 MiB: 4,096 blocks of 32 KiB
    assert pool.shape == (4096, 16, 8, 64) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert process.memory_info().rss - before < 16 << 20  # not committed (torch.zeros would take all 128 MiB)
    pool[3] = 1.5
    assert pool[3].sum().item() == 1.5 * 16 * 8 * 64 and pool[2].abs().sum().item() == 0.0
    assert process.memory_info().rss - before < 16 << 20  # three blocks read or written, not the pool
    assert torch.equal(kv_zeros((2, 3), torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16))
