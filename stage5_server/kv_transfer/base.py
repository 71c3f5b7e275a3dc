"""The KV connector seam: one object per side that moves K/V blocks in and out of the engine's pool.

The engine talks to a connector at four points, two on each side, and nowhere else:

- **scheduler side** (in the engine core, beside the KV cache manager):
  ``get_num_new_matched_tokens``: asked when a waiting request is looked up in the prefix cache: how
  many more of its prompt tokens, past the local hit, can you supply? ``update_state_after_alloc``:
  those blocks now have places in the pool; remember to fill them. ``build_connector_meta``: once a
  step is scheduled, what must the workers do for it (fill these blocks before the forward; copy or
  send these newly full blocks after it)? The answer rides in the step's ``SchedulerOutput``.
- **worker side** (on every rank, beside its KV cache): ``start_load_kv`` before the forward,
  ``wait_for_save`` after it, each with the step's metadata.

A block is named by its prefix-cache hash (``stage4_prefix_cache/kv_cache_utils.py``): the chain of
its tokens with the trust group's salt, the adapter and the images folded in. So the connector keys
its blocks by what isolates them in the pool, and a block stored for one tenant or adapter is found
only by a request of the same one.

Loads here are synchronous: the worker fills the blocks at the start of the step that first reads
them, so a request whose tokens a connector supplies is scheduled at once. vLLM also lets a connector
load asynchronously (``load_kv_async``: the request waits in ``WAITING_FOR_REMOTE_KVS`` until the
worker reports the transfer done) and keep a finished request's blocks until they are sent
(``request_finished``); neither is built here: every transfer of this room is a host-memory copy or
a push the producer's step waits for.

vLLM: ``KVConnectorBase_V1`` in ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``start_load_kv``, ``wait_for_save``), ``KVConnectorRole``, ``KVConnectorMetadata``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stage2_paged.kv_cache import PagedKVCache
    from stage4_prefix_cache.kv_cache_utils import BlockHash, KVCacheBlock
    from stage5_server.config.kv_transfer import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorMetadata:
    """What the scheduler side asks of the workers for one step (each connector fills its own fields)."""


@dataclass
class KVConnectorStats:
    """Counters of the scheduler side, in the engine core's stats snapshot (``/metrics``)."""

    host_hit_tokens: int = 0  # prompt tokens loaded from the offload tier
    p2p_hit_tokens: int = 0  # prompt tokens loaded from blocks another instance sent
    offload_saved_blocks: int = 0
    offload_loaded_blocks: int = 0
    offload_evicted_blocks: int = 0
    offload_used_blocks: int = 0  # gauge
    offload_capacity_blocks: int = 0
    p2p_received_blocks: int = 0
    p2p_buffered_blocks: int = 0  # gauge

    @property
    def external_hit_tokens(self) -> int:
        return self.host_hit_tokens + self.p2p_hit_tokens

    def __add__(self, other: KVConnectorStats) -> KVConnectorStats:
        """Summed over data-parallel ranks (each has its own tier)."""
        return KVConnectorStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass
class FilledBlock:
    """A block whose K/V the step completes: its hash, where it is in the pool, and the transfer its request is
    part of (``transfer_id_of``; None: none)."""

    block_hash: BlockHash
    block_id: int
    transfer_id: str | None = None


def transfer_id_of(request: Any) -> str | None:
    """The id under which a request's blocks cross between instances (``kv_transfer_params["transfer_id"]``, which
    the proxy gives both instances of a request), or None."""
    params = getattr(request, "kv_transfer_params", None)
    return params.get("transfer_id") if params else None


def stored_run(block_hashes: list[BlockHash], start: int, holds) -> list[BlockHash]:
    """The hashes from block ``start`` on that ``holds``, up to the first it does not: a block helps only if
    every block before it is there too."""
    run = []
    for block_hash in block_hashes[start:]:
        if not holds(block_hash):
            break
        run.append(block_hash)
    return run


class KVConnectorBase:
    """Both sides' calls, each a no-op here; a connector overrides the ones its role needs."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int):
        self.config = config
        self.role = role
        self.block_size = block_size
        self.counters = KVConnectorStats()

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   block_hashes: list[BlockHash]) -> int:
        """Tokens past ``num_computed_tokens`` (the local hit, whole blocks) this connector can supply:
        a multiple of the block size, from the blocks of ``block_hashes`` that follow the hit."""
        return 0

    def update_state_after_alloc(self, request: Any, blocks: list[KVCacheBlock], num_external_tokens: int) -> None:
        """``blocks`` (in order, after the local hit) will hold the first ``num_external_tokens`` matched."""

    def build_connector_meta(self, filled: list[FilledBlock]) -> KVConnectorMetadata | None:
        """The workers' part of the step just scheduled; ``filled``: the blocks the step completes."""
        return None

    def step_failed(self, metadata: KVConnectorMetadata | None) -> None:
        """The step that carried ``metadata`` raised: whatever it was to copy may be incomplete."""

    def reset_cache(self) -> None:
        """Forget every stored block (the weights changed: ``weight_sync/``)."""

    def stats(self) -> KVConnectorStats:
        return self.counters

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: PagedKVCache) -> None:
        """The rank's KV cache, (re)allocated at start-up and on waking."""
        self.kv_cache = kv_cache

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Before the forward: fill the blocks the scheduler matched."""

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """After the forward: copy or send the blocks the step completed."""

    def shutdown(self) -> None:
        """Close sockets, stop threads."""


@dataclass
class BlockCopies(KVConnectorMetadata):
    """Copies between the pool and a store, as (block id, store slot) pairs; loads run before the forward,
    saves after it."""

    loads: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
