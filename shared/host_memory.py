"""Host memory for the KV cache on CPU: how much is free, and zeroed tensors paid for only where written.

``available_memory()`` is what the operating system says a new allocation can take without
swapping (``MemAvailable``), or less when a container's memory limit is closer.

``kv_zeros()`` allocates a CPU KV tensor as an anonymous memory map: the kernel hands out zeroed
pages on first write, so a pool sized for many long sequences costs memory for the blocks that
hold tokens, not for its whole size (``torch.zeros`` writes, and so commits, every byte up front).
On other devices it is ``torch.zeros``.

vLLM: the CPU worker takes a fixed KV space (``VLLM_CPU_KVCACHE_SPACE``, 4 GiB by default;
``vllm/v1/worker/cpu_worker.py``) and allocates it with ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup")


def available_memory() -> int:
    """Bytes of RAM a new allocation can take now."""
    import psutil

    available = psutil.virtual_memory().available
    try:  # cgroup v2: a container's limit and what it already uses
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            used = int((CGROUP / "memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return int(available)


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed tensor; on CPU backed by an anonymous memory map, so untouched pages cost nothing."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map alive
