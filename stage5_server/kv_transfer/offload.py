"""An offload tier: full blocks copied to host memory outside the pool, read back on a later hit.

When the pool fills, stage 4's free queue evicts the least recently used cached block, and the next turn
of that conversation prefills it again. With ``--kv-offloading-size GiB`` every block a step completes is
also copied to a second tier, a fixed number of *slots* in host memory, keyed by the block's hash. A
request whose prefix ran out of the pool's cache but not out of the tier gets those blocks back by a copy
instead of a forward pass.

- **Scheduler side** (``OffloadingConnector`` in the engine core): the index. An LRU map hash -> slot,
  bounded by the slots the bytes buy (the bytes are summed over the ranks, as vLLM counts them; each rank
  keeps its own heads and layers of every slot). A save takes a free slot or the least recently used
  one; a hit moves a hash to the most recent end.
- **Worker side** (the same class on each rank): the store, one tensor per layer for K and for V in the
  pool's own layout, ``[slots, block_size, kv_heads, head_dim]``; on a CPU an anonymous memory map, so only
  the slots written cost RAM (on a GPU it would be pinned host memory). ``start_load_kv`` copies the
  step's hits from their slots into their blocks before the forward; ``wait_for_save`` copies the blocks
  the step completed into their slots after it. Loads run before saves, so a slot read and reused in one
  step is read first.

vLLM: ``OffloadingConnector`` in ``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``,
with the CPU tier of ``vllm/v1/kv_offload/cpu/`` (``CPUOffloadingSpec``: ``num_cpu_blocks =
cpu_bytes_to_use // bytes per block``) and its LRU manager.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from shared.host_memory import kv_zeros
from stage4_prefix_cache.kv_cache_utils import BlockHash
from stage5_server.kv_transfer.base import BlockCopies, FilledBlock, KVConnectorBase, stored_run


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config, role, block_size: int, num_slots: int):
        super().__init__(config, role, block_size)
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size: {config.cpu_bytes_to_use} bytes hold no block "
                             "(one block of every layer's K and V, per rank); give more")
        self.num_slots = num_slots
        # scheduler side: hash -> slot, least recently used first; slot -> hash
        self.slot_of: OrderedDict[BlockHash, int] = OrderedDict()
        self.hash_in: dict[int, BlockHash] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.matched: dict[str, list[BlockHash]] = {}  # request id -> the hashes its lookup matched
        self.pending_loads: list[tuple[int, int]] = []  # (block id, slot) for the next step that runs
        self.counters.offload_capacity_blocks = num_slots
        self.key_store: list[torch.Tensor] = []  # worker side: per layer
        self.value_store: list[torch.Tensor] = []

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens, block_hashes):
        found = stored_run(block_hashes, num_computed_tokens // self.block_size, self.slot_of.__contains__)
        self.matched[request.request_id] = found
        return len(found) * self.block_size

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        hashes = self.matched.pop(request.request_id, [])[:num_external_tokens // self.block_size]
        for block, block_hash in zip(blocks, hashes):
            self.slot_of.move_to_end(block_hash)
            self.pending_loads.append((block.block_id, self.slot_of[block_hash]))
        self.counters.offload_loaded_blocks += len(hashes)
        self.counters.host_hit_tokens += len(hashes) * self.block_size

    def build_connector_meta(self, filled: list[FilledBlock]) -> BlockCopies:
        saves = []
        for block in filled:
            if block.block_hash in self.slot_of:
                self.slot_of.move_to_end(block.block_hash)
                continue
            saves.append((block.block_id, self._take_slot(block.block_hash)))
        metadata = BlockCopies(self.pending_loads, saves)
        self.pending_loads = []
        self.counters.offload_saved_blocks += len(saves)
        return metadata

    def _take_slot(self, block_hash: BlockHash) -> int:
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # the least recently used hash gives up its slot
            evicted, slot = self.slot_of.popitem(last=False)
            del self.hash_in[slot]
            self.counters.offload_evicted_blocks += 1
        self.slot_of[block_hash] = slot
        self.hash_in[slot] = block_hash
        return slot

    def step_failed(self, metadata):
        """The saves of a failed step may not have happened: their slots hold nothing usable."""
        for _, slot in getattr(metadata, "saves", ()):
            block_hash = self.hash_in.pop(slot, None)
            if block_hash is not None:
                del self.slot_of[block_hash]
                self.free_slots.append(slot)

    def reset_cache(self):
        self.slot_of.clear()
        self.hash_in.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.matched.clear()
        self.pending_loads = []

    def stats(self):
        self.counters.offload_used_blocks = len(self.slot_of)  # the gauge, read when the snapshot is taken
        return self.counters

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache):
        super().register_kv_caches(kv_cache)
        if self.key_store:
            return  # woken from sleep: the store kept its slots (the index was reset)
        for layer in kv_cache.key:
            shape, dtype = (self.num_slots, *layer.shape[1:]), layer.dtype
            self.key_store.append(host_zeros(shape, dtype, layer.device))
            self.value_store.append(host_zeros(shape, dtype, layer.device))

    def start_load_kv(self, metadata: BlockCopies) -> None:
        if metadata.loads:
            blocks, slots = _index_pair(metadata.loads)
            copy_blocks(self.key_store, self.kv_cache.key, slots, blocks)
            copy_blocks(self.value_store, self.kv_cache.value, slots, blocks)

    def wait_for_save(self, metadata: BlockCopies) -> None:
        if metadata.saves:
            blocks, slots = _index_pair(metadata.saves)
            copy_blocks(self.kv_cache.key, self.key_store, blocks, slots)
            copy_blocks(self.kv_cache.value, self.value_store, blocks, slots)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tier's memory for a pool on ``device``: a lazily backed map on a CPU, pinned memory for a GPU."""
    if device.type == "cpu":
        return kv_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


def copy_blocks(sources: list[torch.Tensor], targets: list[torch.Tensor], source_index: torch.Tensor,
                target_index: torch.Tensor) -> None:
    """``targets[l][target_index[i]] = sources[l][source_index[i]]`` for every layer ``l``."""
    for source, target in zip(sources, targets):
        rows = source.index_select(0, source_index.to(source.device))
        target.index_copy_(0, target_index.to(target.device), rows.to(target.device, non_blocking=True))


def _index_pair(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, slots = zip(*pairs)
    return torch.tensor(blocks), torch.tensor(slots)
