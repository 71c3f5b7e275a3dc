"""One contiguous KV slab; every request reserves its worst case up front.

The slab has ``num_slots`` token slots per layer. Admitting a request carves a contiguous
extent out of it (first fit over the free extents); releasing it returns the extent and
merges it with free neighbours. The accounting below is what stage2 improves on:

- reserved slots: held by live requests;
- used slots: actually written with a token's K/V;
- internal fragmentation: reserved but never written (a short answer in a long reservation);
- external fragmentation: free slots in extents too small for the next reservation.

On CPU the slab is an anonymous memory map (``shared.host_memory.kv_zeros``): the operating
system backs only the slots that get written, so the reserved-but-unwritten waste above is
waste of the pool's capacity, not of RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.host_memory import kv_zeros


@dataclass
class Extent:
    start: int
    length: int


class ContiguousKVCache:
    def __init__(self, num_slots: int, num_layers: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # Tensors are optional so the allocator can be studied without a model.
        self.key = kv_zeros(shape, dtype, device) if num_layers else None
        self.value = kv_zeros(shape, dtype, device) if num_layers else None
        self.free_extents: list[Extent] = [Extent(0, num_slots)]  # sorted by start
        self.reservations: dict[str, Extent] = {}
        self.written: dict[str, int] = {}  # slots written per request

    # ---- allocation ----------------------------------------------------------------
    def can_reserve(self, num_slots: int) -> bool:
        return any(e.length >= num_slots for e in self.free_extents)

    def reserve(self, request_id: str, num_slots: int) -> int | None:
        """Reserve ``num_slots`` contiguous slots (first fit); return the start or None."""
        if request_id in self.reservations:
            raise ValueError(f"request_id: {request_id!r} already holds a reservation")
        for i, extent in enumerate(self.free_extents):
            if extent.length >= num_slots:
                start = extent.start
                if extent.length == num_slots:
                    del self.free_extents[i]
                else:
                    self.free_extents[i] = Extent(start + num_slots, extent.length - num_slots)
                self.reservations[request_id] = Extent(start, num_slots)
                self.written[request_id] = 0
                return start
        return None

    def release(self, request_id: str) -> None:
        extent = self.reservations.pop(request_id)
        del self.written[request_id]
        self.free_extents.append(extent)
        self.free_extents.sort(key=lambda e: e.start)
        merged: list[Extent] = []
        for e in self.free_extents:
            if merged and merged[-1].start + merged[-1].length == e.start:
                merged[-1] = Extent(merged[-1].start, merged[-1].length + e.length)
            else:
                merged.append(e)
        self.free_extents = merged

    def mark_written(self, request_id: str, num_tokens: int) -> None:
        """Record that the request's first ``num_tokens`` slots now hold K/V."""
        extent = self.reservations[request_id]
        assert num_tokens <= extent.length, "wrote past the reservation"
        self.written[request_id] = max(self.written[request_id], num_tokens)

    def start_of(self, request_id: str) -> int:
        return self.reservations[request_id].start

    # ---- accounting ----------------------------------------------------------------
    @property
    def reserved_slots(self) -> int:
        return sum(e.length for e in self.reservations.values())

    @property
    def used_slots(self) -> int:
        return sum(self.written.values())

    @property
    def free_slots(self) -> int:
        return self.num_slots - self.reserved_slots

    @property
    def internal_fragmentation(self) -> int:
        """Reserved slots that hold no token."""
        return self.reserved_slots - self.used_slots

    def external_fragmentation(self, request_slots: int) -> int:
        """Free slots that a reservation of ``request_slots`` cannot use: they lie in smaller extents."""
        return sum(e.length for e in self.free_extents if e.length < request_slots)

    def largest_free_extent(self) -> int:
        return max((e.length for e in self.free_extents), default=0)
