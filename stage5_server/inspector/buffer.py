"""A bounded buffer that drops its oldest items when full, and counts what each reader missed.

Records pile up wherever their reader is slower than the engine: in the engine core until the busy loop
publishes them, in an API server until a page takes them. Neither side may wait for the other, so each
holds at most ``capacity`` items: a new one pushes the oldest out, and the reader is told how many it
missed. The engine never blocks on a viewer.

Two ways to read, one per buffer: ``drain`` (one reader takes everything: the engine core's buffer), or
``read(since)`` (any number of readers, each with its own position: an API server's pages).

vLLM: no counterpart (its metrics are counters, summed rather than queued).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class RecordBuffer(Generic[T]):
    """Thread-safe: one thread appends while others read."""

    def __init__(self, capacity: int = 1024):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity: must be a positive integer, got {capacity!r}")
        self.items: deque[T] = deque(maxlen=capacity)
        self.next_seq = 0  # the sequence number the next item gets
        self.dropped = 0  # pushed out before ``drain`` took them
        self._lock = threading.Lock()

    def append(self, item: T) -> None:
        with self._lock:
            if len(self.items) == self.items.maxlen:
                self.dropped += 1
            self.items.append(item)
            self.next_seq += 1

    def drain(self) -> tuple[list[T], int]:
        """Every item held, oldest first, and how many were dropped since the last drain; the buffer empties."""
        with self._lock:
            items, dropped = list(self.items), self.dropped
            self.items.clear()
            self.dropped = 0
        return items, dropped

    def read(self, since: int) -> tuple[list[T], int, int]:
        """The items numbered ``since`` and later: ``(items, the number to read from next, how many of those
        after ``since`` were pushed out before this read)``. The buffer keeps them for other readers."""
        with self._lock:
            first = self.next_seq - len(self.items)
            start = max(since, first)
            items = list(self.items)[start - first:] if start < self.next_seq else []
            return items, self.next_seq, start - since if since < start else 0

    def __len__(self) -> int:
        return len(self.items)
