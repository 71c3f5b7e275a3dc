"""Trust groups hold through adapters, images and the KV offload tier: two groups (``two_trust_groups``)
sending the same prompt under the same LoRA adapter, or with the same image, never report ``cached_tokens``
> 0 across the groups (in ``usage.prompt_tokens_details`` and in ``vllm:prefix_cache_hits_total``), while a
second key of the first group does hit (and another image, in the same group, hits only the blocks before
it); blocks the offload tier keeps for one group come back to that group only. The real server on the tiny
Llama with an adapter made with PEFT, and on the tiny LLaVA."""

from __future__ import annotations

import os

import requests

from stage5_server.server import create_app
from tests.stage5.lora_adapters import make_adapter
from tests.stage5.server_fixtures import auth, make_llm, metric, running_server, wait_until
from tests.stage5.test_multimodal import data_url, picture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Blocks of a few tokens, found through a table, waste at most one partial block. " * 2


def cached_tokens(url: str, key: str, route: str, body: dict) -> int:
    """The request's ``cached_tokens``, checked against the hits /metrics counted for it."""
    def hits() -> float:
        text = requests.get(f"{url}/metrics", headers=auth(key), timeout=30).text
        return metric(text, "vllm:prefix_cache_hits_total") or 0.0

    before = hits()
    response = requests.post(f"{url}{route}", json=body, headers=auth(key), timeout=120)
    assert response.status_code == 200, response.text
    tokens = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert wait_until(lambda: hits() - before == tokens, timeout=5), (hits() - before, tokens)
    return tokens


def across_groups(url: str, route: str, body: dict, groups) -> None:
    assert cached_tokens(url, groups.a_key, route, body) == 0  # the first sight of this prompt
    assert cached_tokens(url, groups.b_key, route, body) == 0  # another group: none of group a's blocks
    assert cached_tokens(url, groups.a_other_key, route, body) > 0  # group a's other key: its group's blocks
    assert cached_tokens(url, groups.b_key, route, body) > 0  # group b's own blocks, from its first request


def test_the_same_adapter_and_prompt_share_no_blocks_across_groups(tiny_llama, tmp_path, two_trust_groups):
    adapter = make_adapter(tiny_llama, tmp_path / "shared-adapter", seed=4, r=4, target_modules=("q_proj",))
    app = create_app(make_llm(tiny_llama, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
                              enable_prefix_caching=True),
                     api_keys=two_trust_groups.api_keys, served_model_name="tiny",
                     lora_modules=[("shared", str(adapter))])
    with running_server(app) as server:
        across_groups(server.url, "/v1/completions", {"model": "shared", "prompt": PROMPT, "max_tokens": 1},
                      two_trust_groups)
        chat = {"model": "shared", "messages": [{"role": "user", "content": PROMPT + " (chat)"}], "max_tokens": 1}
        across_groups(server.url, "/v1/chat/completions", chat, two_trust_groups)


def test_blocks_the_offload_tier_keeps_for_one_group_come_back_to_that_group_only(tiny_llama, two_trust_groups):
    """A pool of 8 blocks of 16 tokens and a tier beside it: each prompt of about 100 tokens pushes the last
    one's blocks out of the pool (the tier keeps them), from which only the same group's requests take them."""
    app = create_app(make_llm(tiny_llama, device="cpu", dtype="float32", enable_prefix_caching=True,
                              num_kv_blocks=8, max_model_len=128, max_num_seqs=1, kv_offloading_size=0.001),
                     api_keys=two_trust_groups.api_keys, served_model_name="tiny")
    prompt = "An offload tier keeps a block the pool has dropped, for the trust group that computed it. " * 2
    flush = "Another prompt as long, pushing the first one's blocks from the pool into the tier. " * 2

    def host_hits(url: str, key: str, text: str) -> float:
        def counted() -> float:
            metrics = requests.get(f"{url}/metrics", headers=auth(key), timeout=30).text
            return metric(metrics, "vllm:prompt_tokens_cached_by_source_total", source="host") or 0.0

        before = counted()
        response = requests.post(f"{url}/v1/completions", headers=auth(key), timeout=120,
                                 json={"prompt": text, "max_tokens": 1})
        assert response.status_code == 200, response.text
        return counted() - before

    with running_server(app) as server:
        groups = two_trust_groups
        for key, expected in ((groups.a_key, 0), (groups.b_key, 0), (groups.a_other_key, "some"),
                              (groups.b_key, "some")):
            host_hits(server.url, groups.a_key, key + flush)  # the prompt's blocks leave the pool
            hits = host_hits(server.url, key, prompt)
            assert (hits > 0) if expected == "some" else (hits == 0), (key, hits)


def test_the_same_image_and_prompt_share_no_blocks_across_groups(tiny_llava, two_trust_groups):
    app = create_app(make_llm(tiny_llava, dtype="float32", device="cpu", attention_backend="torch",
                              max_num_batched_tokens=32, enable_prefix_caching=True),
                     api_keys=two_trust_groups.api_keys, served_model_name="tiny-llava")
    def body(image: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": PROMPT}]
        return {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 1}

    with running_server(app) as server:
        across_groups(server.url, "/v1/chat/completions", body(data_url(picture(9))), two_trust_groups)
        key = two_trust_groups.a_other_key
        same = cached_tokens(server.url, key, "/v1/chat/completions", body(data_url(picture(9))))
        other = cached_tokens(server.url, key, "/v1/chat/completions", body(data_url(picture(10))))
        assert other < same  # another image under the same group: only the blocks before the image
