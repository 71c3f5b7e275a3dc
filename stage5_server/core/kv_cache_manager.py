"""Stage 4's KV cache manager, with stage 5's extra keys in each block's hash.

Stage 4 hashes a block from its parent's hash, its token ids and its extra keys (the seeds'
``extra_hashes``: there, the cache salt). Stage 5's requests carry two more things that decide what
a block's K/V are, so its blocks carry two more sources (``block_extra_keys``), in this order:

1. ``("lora", name)`` and ``("lora", path)``: the adapter the request runs under (``lora/``), on
   every block; the same name reloaded from another directory is another adapter;
2. ``("mm", image hash)``: each image whose placeholder tokens the block overlaps (``multimodal/``),
   in the order the images appear. An image's placeholders are all one token id, so two prompts
   with the same text and different images have the same token ids: without this key the second
   would get the first one's K/V. Blocks before the first image keep their text-only hash and are
   shared with text-only prompts; every block from the image's on differs (its own key, or its
   parent's hash chained from it);
3. stage 4's ``("salt", cache salt)``.

With a KV connector (``kv_transfer/``), a prefix lookup asks it too: the blocks it can supply past the
local hit are taken from the free queue, given their hashes and handed back as cached blocks, and the
connector fills them at the start of the next step (before anything reads them). The lookup then finds
them as ordinary hits, so stage 3's admission is unchanged. After scheduling, ``filled_blocks`` names the
blocks each step completes, for the connector to copy or send.

vLLM: ``generate_block_hash_extra_keys`` (``_gen_lora_extra_hash_keys``, ``_gen_mm_extra_hash_keys``)
in ``vllm/v1/core/kv_cache_utils.py``; the connector's lookup in ``Scheduler.schedule``
(``vllm/v1/core/sched/scheduler.py``: ``get_num_new_matched_tokens``, ``update_state_after_alloc``).
"""

from __future__ import annotations

from stage4_prefix_cache.kv_cache_manager import KVCacheManager as _KVCacheManager
from stage4_prefix_cache.kv_cache_utils import ExtraKey, KVCacheBlock
from stage5_server.core.request import Request
from stage5_server.kv_transfer import FilledBlock, KVConnectorBase


class KVCacheManager(_KVCacheManager):
    kv_connector: KVConnectorBase | None = None  # set by the scheduler when the engine has one

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if self.kv_connector is not None and self.enable_caching and \
                not getattr(request, "skip_reading_prefix_cache", False):
            self._take_connector_blocks(request, self.kv_connector)
        return super().get_computed_blocks(request)

    def _take_connector_blocks(self, request: Request, connector: KVConnectorBase) -> None:
        """The blocks ``connector`` supplies past the local hit become cached blocks of the pool."""
        pool, block_size = self.block_pool, self.block_size
        hashes = self._get_block_hashes(request)[:(request.num_tokens - 1) // block_size]
        local = []
        for block_hash in hashes:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            local.append(block)
        num_blocks = connector.get_num_new_matched_tokens(request, len(local) * block_size, hashes) // block_size
        if num_blocks == 0:
            return
        pool.touch(local)  # the allocation below must not evict the local hit
        num_blocks = min(num_blocks, pool.get_num_free_blocks())
        blocks = pool.get_new_blocks(num_blocks)
        pool.cache_full_blocks(blocks, hashes[len(local):len(local) + num_blocks], 0, num_blocks)
        connector.update_state_after_alloc(request, blocks, num_blocks * block_size)
        pool.free_blocks(reversed(local + blocks))  # cached and free: the lookup that follows hits them

    def filled_blocks(self, request: Request, num_new_tokens: int) -> list[FilledBlock]:
        """The blocks of known tokens whose K/V the request's next ``num_new_tokens`` positions complete."""
        start = request.num_computed_tokens // self.block_size
        end = min(request.num_computed_tokens + num_new_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return []
        hashes, table = self._get_block_hashes(request), self.req_to_blocks[request.request_id]
        return [FilledBlock(hashes[i], table[i].block_id) for i in range(start, end)]

    def block_extra_keys(self, request: Request, start: int, end: int) -> tuple[ExtraKey, ...]:
        keys: list[ExtraKey] = []
        adapter = getattr(request, "lora_request", None)
        if adapter is not None:
            keys += [("lora", adapter.lora_name), ("lora", adapter.lora_path)]
        keys += [("mm", f.identifier) for f in getattr(request, "mm_features", ()) if f.overlaps(start, end)]
        return (*keys, *super().block_extra_keys(request, start, end))
