"""The seeds' cache-key paragraph, worked from the real hash: a LoRA named tenant-A and a cache salt
tenant-A name different blocks here, and the same prompt under two adapters, or under one adapter
loaded again with other weights from the same directory, shares no block.

Calls stage4_prefix_cache.kv_cache_utils (encode_block, hash_block_tokens) and stage 5's
KVCacheManager.block_extra_keys on real stage-5 Requests carrying a LoRARequest. No model runs.

Run: .venv/bin/python docs/snippets/lora_cache_key.py
"""

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from shared import SamplingParams  # noqa: E402
from stage4_prefix_cache.kv_cache_utils import (  # noqa: E402
    encode_block,
    hash_block_tokens,
)
from stage5_server.core.kv_cache_manager import KVCacheManager  # noqa: E402
from stage5_server.core.request import Request  # noqa: E402
from stage5_server.lora import LoRARequest  # noqa: E402

ABCD = [1, 2, 3, 4]  # the block A B C D
as_lora = (("lora", "tenant-A"),)
as_salt = (("salt", "tenant-A"),)
untagged = ("tenant-A",)  # old vLLM: one tuple of every extra key's value, no source

print("the values alone, as old vLLM mixed them:")
print(f"  {untagged} == {untagged} -> one hash for both")
print()
for label, keys in (("LoRA tenant-A", as_lora), ("salt tenant-A", as_salt)):
    encoded = encode_block(None, ABCD, keys)
    print(f"{label}: extra-key bytes {encoded[-22:-11].hex(' ')}")
    print(f"{' ' * len(label)}                  {encoded[-11:].hex(' ')}")
    print(f"{' ' * len(label)}  H = {hash_block_tokens(None, ABCD, keys).hex()[:32]}...")
print()

def digest(weights: str) -> str:
    """Stands in for the SHA-256 of an adapter's tensors (LoRAModel.digest), which the server computes at load."""
    return hashlib.sha256(weights.encode()).hexdigest()


prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # A B C D E F G H: two full blocks
greedy = SamplingParams(temperature=0)
sql = LoRARequest("sql", 1, "/adapters/sql", weights_digest=digest("sql, first training run"))
retrained = LoRARequest("sql", 3, "/adapters/sql", weights_digest=digest("sql, second training run"))  # same path
chat = LoRARequest("chat", 2, "/adapters/chat", weights_digest=digest("chat"))
requests = {"base": Request("r0", prompt, greedy), "sql": Request("r1", prompt, greedy, lora_request=sql),
            "sql again": Request("r2", prompt, greedy, lora_request=sql),
            "sql, new weights": Request("r3", prompt, greedy, lora_request=retrained),
            "chat": Request("r4", prompt, greedy, lora_request=chat)}
manager = KVCacheManager(block_size=4, num_blocks=8)
for label, request in requests.items():
    keys = manager.block_extra_keys(request, 0, 4)  # the same on every block of a text prompt
    parent, hashes = None, []
    for start in range(0, len(prompt), 4):
        parent = hash_block_tokens(parent, prompt[start:start + 4], manager.block_extra_keys(request, start, start + 4))
        hashes.append(parent)
    shown = tuple((source, value if len(value) < 20 else value[:12] + "...") for source, value in keys)
    print(f"{label:>16}: extra keys {shown}")
    print(f"{'':>16}  blocks {' '.join(h.hex()[:12] for h in hashes)}")
