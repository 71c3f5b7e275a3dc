"""Stage 5's extra keys in a block's hash (``core/kv_cache_manager.py``): the adapter's, on every block of a
request that runs under one, and an image's, on the blocks its placeholders overlap, beside stage 4's salt.
Stage 4's own prefix-cache machine runs again with adapters in the mix."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from stage5_server.core.kv_cache_manager import KVCacheManager
from stage5_server.lora import LoRARequest
from stage5_server.multimodal.inputs import MultiModalFeature
from tests.stage4.fake_request import FakeRequest
from tests.stage4.test_prefix_cache_core import admit, req
from tests.stage4.test_prefix_cache_properties import PrefixCacheMachine, prompts


@dataclass
class AdapterRequest(FakeRequest):
    lora_request: LoRARequest | None = None


def adapter(name: str) -> LoRARequest:
    return LoRARequest(name, 1, f"/adapters/{name}")


def test_an_adapter_and_a_salt_of_the_same_name_share_no_block():
    kv = KVCacheManager(block_size=4, num_blocks=8)
    tokens = req("x", "ABCDEFGHI").all_token_ids
    admit(kv, AdapterRequest("lora", list(tokens), lora_request=adapter("tenant-A")))
    assert kv.get_computed_blocks(req("salt", "ABCDEFGHI", cache_salt="tenant-A")) == ([], 0)
    assert kv.get_computed_blocks(req("base", "ABCDEFGHI")) == ([], 0)
    _, hit = kv.get_computed_blocks(AdapterRequest("again", list(tokens), lora_request=adapter("tenant-A")))
    assert hit == 8


def test_the_same_adapter_name_and_path_with_other_weights_shares_no_block():
    """A block is keyed by the digest of the adapter's weights: loaded again from the same directory with
    other weights (another digest), or under another load number when no digest is known, it is another
    adapter."""
    kv = KVCacheManager(block_size=4, num_blocks=16)
    tokens = list(req("x", "ABCDEFGHI").all_token_ids)
    first = LoRARequest("tenant-A", 1, "/adapters/a", weights_digest="1" * 64)
    admit(kv, AdapterRequest("first", tokens, lora_request=first))
    same = LoRARequest("tenant-A", 2, "/adapters/a", weights_digest="1" * 64)  # loaded again, the same weights
    assert kv.get_computed_blocks(AdapterRequest("same", tokens, lora_request=same))[1] == 8
    changed = LoRARequest("tenant-A", 3, "/adapters/a", weights_digest="2" * 64)
    assert kv.get_computed_blocks(AdapterRequest("changed", tokens, lora_request=changed)) == ([], 0)
    admit(kv, AdapterRequest("unchecked", tokens, lora_request=adapter("tenant-A")))
    reloaded = LoRARequest("tenant-A", 2, "/adapters/tenant-A")  # no digest: another load number
    assert kv.get_computed_blocks(AdapterRequest("reloaded", tokens, lora_request=reloaded)) == ([], 0)


def test_the_image_hash_is_added_only_to_blocks_its_placeholders_overlap():
    class Prompt:
        cache_salt = "tenant"
        mm_features = [MultiModalFeature("img", offset=20, length=25, pixel_values=b"", shape=(0,))]

    keys = KVCacheManager(block_size=16, num_blocks=8).block_extra_keys
    assert keys(Prompt(), 0, 16) == (("salt", "tenant"),)
    assert keys(Prompt(), 16, 32) == (("mm", "img"), ("salt", "tenant"))
    assert keys(Prompt(), 32, 48) == (("mm", "img"), ("salt", "tenant"))  # 20 + 25 = 45
    assert keys(Prompt(), 48, 64) == (("salt", "tenant"),)


class AdapterPrefixCacheMachine(PrefixCacheMachine):
    """Stage 4's machine over stage 5's manager, with requests under adapters too: a hit must never serve a
    block computed under another adapter (or none)."""

    manager_class = KVCacheManager

    def identity(self, request: FakeRequest) -> tuple:
        lora = getattr(request, "lora_request", None)
        keys = () if lora is None else tuple(("lora", part) for part in lora.cache_key)
        return keys + super().identity(request)

    @rule(prompt=prompts, salt=st.sampled_from([None, "tenant-A"]), name=st.sampled_from([None, "tenant-A"]),
          chunk=st.integers(1, 12))
    def add_adapter_request(self, prompt, salt, name, chunk) -> None:
        self._add(AdapterRequest(f"r{self.next_id}", list(prompt), cache_salt=salt,
                                 lora_request=None if name is None else adapter(name)), chunk)


TestAdapterPrefixCacheMachine = AdapterPrefixCacheMachine.TestCase
TestAdapterPrefixCacheMachine.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
