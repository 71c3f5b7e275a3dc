"""The image's hash in the prefix-cache key, on exactly the blocks its placeholders overlap.

Stage 4 hashes a block from its parent's hash, its token ids and extra keys that are the same for
every block of a request (its LoRA adapter, its cache salt). An image's placeholder tokens are all
the same id: two prompts with the same text and different images have the same token ids, and
stage 4 would hand the second the first one's K/V. So a block that holds any of an image's
placeholder positions also carries ``("mm", image hash)`` among its extra keys, in the order the
images appear (between the LoRA key and the salt). Blocks before the first image keep their
text-only hash and are shared with text-only prompts; every block from the image's on differs
(its own key, or its parent's hash chained from it).

vLLM: ``_gen_mm_extra_hash_keys`` and ``generate_block_hash_extra_keys`` in
``vllm/v1/core/kv_cache_utils.py``.
"""

from __future__ import annotations

from stage4_prefix_cache.kv_cache_manager import KVCacheManager
from stage4_prefix_cache.kv_cache_utils import BlockHash, ExtraKey, hash_block_tokens, request_extra_keys


def block_extra_keys(request, start: int, end: int) -> tuple[ExtraKey, ...]:
    """The extra keys of the block holding positions ``[start, end)``: LoRA, then the hash of each
    image overlapping it, then the salt."""
    keys = request_extra_keys(request)
    images = [("mm", f.identifier) for f in getattr(request, "mm_features", ()) if f.overlaps(start, end)]
    if not images:
        return keys
    return (*[k for k in keys if k[0] != "salt"], *images, *[k for k in keys if k[0] == "salt"])


class MultiModalKVCacheManager(KVCacheManager):
    def _get_block_hashes(self, request) -> list[BlockHash]:
        if not getattr(request, "mm_features", None):
            return super()._get_block_hashes(request)
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(tokens) // self.block_size):
            start, end = i * self.block_size, (i + 1) * self.block_size
            parent = hash_block_tokens(parent, tokens[start:end], block_extra_keys(request, start, end), self.hash_fn)
            hashes.append(parent)
        return hashes
