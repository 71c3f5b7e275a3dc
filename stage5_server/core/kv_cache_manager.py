"""Stage 4's KV cache manager, with stage 5's extra keys in each block's hash.

Stage 4 hashes a block from its parent's hash, its token ids and its extra keys (the seeds'
``extra_hashes``: there, the cache salt). Stage 5's requests carry two more things that decide what
a block's K/V are, so its blocks carry two more sources (``block_extra_keys``), in this order:

1. ``("lora", ...)``: the adapter the request runs under (``lora/``), on every block: its name and the
   digest of its weights (``LoRARequest.cache_key``), so the same name loaded again with other weights,
   from the same directory or another, is another adapter;
2. ``("mm", image hash)``: each image whose placeholder tokens the block overlaps (``multimodal/``),
   in the order the images appear. An image's placeholders are all one token id, so two prompts
   with the same text and different images have the same token ids: without this key the second
   would get the first one's K/V. Blocks before the first image keep their text-only hash and are
   shared with text-only prompts; every block from the image's on differs (its own key, or its
   parent's hash chained from it);
3. stage 4's ``("salt", cache salt)``.

With a KV connector (``kv_transfer/``), a prefix lookup asks it too: the blocks it can supply past the
local hit enter the pool as cached blocks (``kv_transfer/lookup.py``), so stage 3's admission is
unchanged; ``filled_blocks`` names the blocks each step completes, for the connector to copy or send.

vLLM: ``generate_block_hash_extra_keys`` (``_gen_lora_extra_hash_keys``, ``_gen_mm_extra_hash_keys``)
in ``vllm/v1/core/kv_cache_utils.py``; the connector's lookup in ``Scheduler.schedule``
(``vllm/v1/core/sched/scheduler.py``: ``get_num_new_matched_tokens``, ``update_state_after_alloc``).
"""

from __future__ import annotations

from stage4_prefix_cache.kv_cache_manager import KVCacheManager as _KVCacheManager
from stage4_prefix_cache.kv_cache_utils import ExtraKey, KVCacheBlock
from stage5_server.core.request import Request
from stage5_server.kv_transfer import FilledBlock, KVConnectorBase
from stage5_server.kv_transfer.base import transfer_id_of
from stage5_server.kv_transfer.lookup import filled_blocks, take_connector_blocks


class KVCacheManager(_KVCacheManager):
    kv_connector: KVConnectorBase | None = None  # set by the scheduler when the engine has one

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if self.kv_connector is not None and self.enable_caching and \
                not getattr(request, "skip_reading_prefix_cache", False):  # kv_transfer/lookup.py
            take_connector_blocks(self.block_pool, self.kv_connector, request,
                                  self._get_block_hashes(request)[:(request.num_tokens - 1) // self.block_size],
                                  self.block_size)
        return super().get_computed_blocks(request)

    def filled_blocks(self, request: Request, num_new_tokens: int) -> list[FilledBlock]:
        return filled_blocks(self._get_block_hashes(request), self.req_to_blocks[request.request_id],
                             request.num_computed_tokens, num_new_tokens, request.num_tokens, self.block_size,
                             transfer_id_of(request))

    def block_extra_keys(self, request: Request, start: int, end: int) -> tuple[ExtraKey, ...]:
        keys: list[ExtraKey] = []
        adapter = getattr(request, "lora_request", None)
        if adapter is not None:
            keys += [("lora", part) for part in adapter.cache_key]
        keys += [("mm", f.identifier) for f in getattr(request, "mm_features", ()) if f.overlaps(start, end)]
        return (*keys, *super().block_extra_keys(request, start, end))
