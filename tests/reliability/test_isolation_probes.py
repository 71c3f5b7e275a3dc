"""Trust groups hold through adapters and images: two groups sending the same prompt under the same
LoRA adapter, or with the same image, never report ``cached_tokens`` > 0 across the groups (in
``usage.prompt_tokens_details`` and in ``vllm:prefix_cache_hits_total``), while a second key of the
first group does hit (and another image, in the same group, hits only the blocks before it). The real
server on the tiny Llama with an adapter made with PEFT, and on the tiny LLaVA."""

from __future__ import annotations

import os

import requests

from stage5_server.server import create_app
from tests.stage5.lora_adapters import make_adapter
from tests.stage5.server_fixtures import auth, make_llm, metric, running_server, wait_until
from tests.stage5.test_multimodal import data_url, picture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
KEYS = {"alice-key": "teamA", "alan-key": "teamA", "bob-key": "teamB"}
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


def across_groups(url: str, route: str, body: dict) -> None:
    assert cached_tokens(url, "alice-key", route, body) == 0  # the first sight of this prompt
    assert cached_tokens(url, "bob-key", route, body) == 0  # another group: none of teamA's blocks
    assert cached_tokens(url, "alan-key", route, body) > 0  # teamA's other key: its group's blocks
    assert cached_tokens(url, "bob-key", route, body) > 0  # teamB's own blocks, from its first request


def test_the_same_adapter_and_prompt_share_no_blocks_across_groups(tiny_llama, tmp_path):
    adapter = make_adapter(tiny_llama, tmp_path / "shared-adapter", seed=4, r=4, target_modules=("q_proj",))
    app = create_app(make_llm(tiny_llama, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
                              enable_prefix_caching=True),
                     api_keys=KEYS, served_model_name="tiny", lora_modules=[("shared", str(adapter))])
    with running_server(app) as server:
        across_groups(server.url, "/v1/completions", {"model": "shared", "prompt": PROMPT, "max_tokens": 1})
        chat = {"model": "shared", "messages": [{"role": "user", "content": PROMPT + " (chat)"}], "max_tokens": 1}
        across_groups(server.url, "/v1/chat/completions", chat)


def test_the_same_image_and_prompt_share_no_blocks_across_groups(tiny_llava):
    app = create_app(make_llm(tiny_llava, dtype="float32", device="cpu", attention_backend="torch",
                              max_num_batched_tokens=32, enable_prefix_caching=True),
                     api_keys=KEYS, served_model_name="tiny-llava")
    def body(image: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": PROMPT}]
        return {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 1}

    with running_server(app) as server:
        across_groups(server.url, "/v1/chat/completions", body(data_url(picture(9))))
        same = cached_tokens(server.url, "alan-key", "/v1/chat/completions", body(data_url(picture(9))))
        other = cached_tokens(server.url, "alan-key", "/v1/chat/completions", body(data_url(picture(10))))
        assert other < same  # another image under the same group: only the blocks before the image
