"""The image's hash in the prefix-cache key: the same prompt tokens with two different images.

A 64-token prompt in blocks of 16: text at positions 0..19, an image's 25 placeholder tokens at
20..44 (all the same token id), text at 45..63. Each block is hashed by stage 4's
``hash_block_tokens`` with the extra keys stage 5 gives it (``core/kv_cache_manager.py``):
``("mm", image hash)`` only where the block overlaps the image. Nothing is typed in by hand.

Run: .venv/bin/python docs/snippets/mm_block_hashes.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from stage4_prefix_cache.kv_cache_utils import hash_block_tokens  # noqa: E402
from stage5_server.core.kv_cache_manager import KVCacheManager  # noqa: E402
from stage5_server.multimodal.inputs import MultiModalFeature  # noqa: E402

BLOCK, IMAGE_TOKEN = 16, 512
block_extra_keys = KVCacheManager(BLOCK, num_blocks=8).block_extra_keys
TOKENS = list(range(20)) + [IMAGE_TOKEN] * 25 + list(range(100, 119))


class Prompt:
    cache_salt = None  # no LoRA, no salt: only the image's key

    def __init__(self, image_hash: str):
        self.mm_features = [MultiModalFeature(image_hash, offset=20, length=25, pixel_values=b"", shape=(0,))]


for image in ("h(cat)", "h(dog)"):
    parent = None
    for start in range(0, len(TOKENS), BLOCK):
        keys = block_extra_keys(Prompt(image), start, start + BLOCK)
        parent = hash_block_tokens(parent, TOKENS[start:start + BLOCK], keys)
        print(f"{image}  block {start:2d}-{start + BLOCK - 1:2d}  extra keys {keys!s:22}  "
              f"hash {parent.hex()[:12]}")
