"""Runtime adapters belong to the trust group that loaded them, probed from outside with two API keys in two
groups (``two_trust_groups``): the other group gets a 404 for such an adapter on every route that takes a
model (generation, tokenizing, the model card, unloading) and never sees it in ``/v1/models``; an adapter
listed at start-up serves every group; no response shows where an adapter lies on the server's disk. An
adapter's cached K/V is tied to its weights: unloaded, changed on disk and loaded again under the same name
and path, it hits none of the blocks its old weights computed. A load refuses weights that are not floating
point, or hold NaN or infinity, with a 400 naming the tensor, before anything is listed.

The real server on the tiny Llama, adapters made with PEFT.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from stage5_server.server import create_app
from tests.stage5.lora_adapters import make_adapter
from tests.stage5.server_fixtures import make_llm, running_server

BASE = "tiny-base"
ENGINE = dict(device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              enable_prefix_caching=True)
PROMPT = "Adapters that belong to one team stay with that team, whatever the other team asks for. " * 2
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("owned-adapters")
    first = make_adapter(tiny_llama, root / "first", seed=11, r=4, target_modules=("q_proj", "v_proj"))
    second = make_adapter(tiny_llama, root / "second", seed=12, r=4, target_modules=("q_proj", "v_proj"))
    shutil.copytree(first, root / "at-start")
    return {"root": root, "first": first, "second": second, "at-start": root / "at-start"}


@pytest.fixture(scope="module")
def served(tiny_llama, adapter_dirs, two_trust_groups):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        app = create_app(make_llm(tiny_llama, **ENGINE), api_keys=two_trust_groups.api_keys,
                         served_model_name=BASE, lora_modules=[("at-start", str(adapter_dirs["at-start"]))])
    with running_server(app) as server:
        yield server.url


def call(url: str, key: str, method: str, route: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{url}{route}", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})


def load(url: str, key: str, name: str, path) -> requests.Response:
    return call(url, key, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(url: str, key: str, name: str) -> requests.Response:
    return call(url, key, "POST", "/v1/unload_lora_adapter", {"lora_name": name})


@contextmanager
def loaded(url: str, key: str, name: str, path) -> Iterator[None]:
    """Adapter ``name`` loaded by ``key``'s group for the block, unloaded by it after."""
    response = load(url, key, name, path)
    assert response.status_code == 200, response.text
    try:
        yield
    finally:
        assert unload(url, key, name).status_code == 200


def complete(url: str, key: str, model: str, prompt: str = "def f(x):") -> requests.Response:
    return call(url, key, "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True})


def listed(url: str, key: str) -> list[dict]:
    response = call(url, key, "GET", "/v1/models")
    assert response.status_code == 200, response.text
    return response.json()["data"]


def every_model_route(url: str, key: str, model: str) -> dict[str, int]:
    """The status of each route that takes a model name, asked for ``model`` with ``key``."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {
        "completions": complete(url, key, model).status_code,
        "chat": call(url, key, "POST", "/v1/chat/completions", chat).status_code,
        "chat-stream": call(url, key, "POST", "/v1/chat/completions", {**chat, "stream": True}).status_code,
        "responses": call(url, key, "POST", "/v1/responses", {"model": model, "input": "hi",
                                                              "max_output_tokens": 2}).status_code,
        "tokenize": call(url, key, "POST", "/tokenize", {"model": model, "prompt": "hi"}).status_code,
        "detokenize": call(url, key, "POST", "/detokenize", {"model": model, "tokens": [1, 2]}).status_code,
        "model card": call(url, key, "GET", f"/v1/models/{model}").status_code,
    }


def test_another_group_gets_a_404_for_an_adapter_on_every_route_and_cannot_unload_it(served, adapter_dirs,
                                                                                      two_trust_groups):
    groups = two_trust_groups
    with loaded(served, groups.a_key, "team-a-only", adapter_dirs["first"]):
        owner = every_model_route(served, groups.a_other_key, "team-a-only")  # the group's other key too
        assert set(owner.values()) == {200}, owner
        stranger = every_model_route(served, groups.b_key, "team-a-only")
        assert set(stranger.values()) == {404}, stranger
        refused = unload(served, groups.b_key, "team-a-only")
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        assert complete(served, groups.a_key, "team-a-only").status_code == 200  # still there for its group


def test_each_group_may_load_its_own_adapter_under_a_name_another_group_uses(served, adapter_dirs,
                                                                             two_trust_groups):
    groups = two_trust_groups
    with loaded(served, groups.a_key, "ours", adapter_dirs["first"]):
        with loaded(served, groups.b_key, "ours", adapter_dirs["second"]):
            text_a = complete(served, groups.a_key, "ours").json()["choices"][0]["text"]
            text_b = complete(served, groups.b_key, "ours").json()["choices"][0]["text"]
            assert text_a != text_b  # each group's name is its own adapter
        assert complete(served, groups.a_key, "ours").status_code == 200


def test_the_models_list_shows_each_key_what_it_may_use_and_no_adapter_path(served, adapter_dirs,
                                                                            two_trust_groups):
    groups = two_trust_groups
    with loaded(served, groups.a_key, "listed-for-a", adapter_dirs["first"]):
        ids = {key: {card["id"] for card in listed(served, key)}
               for key in (groups.a_key, groups.a_other_key, groups.b_key)}
        assert ids[groups.a_key] == ids[groups.a_other_key] == {BASE, "at-start", "listed-for-a"}
        assert ids[groups.b_key] == {BASE, "at-start"}
        for key in (groups.a_key, groups.b_key):
            text = call(served, key, "GET", "/v1/models").text + call(served, key, "GET", "/v1/models/at-start").text
            assert str(adapter_dirs["root"]) not in text, text


def cached_tokens(url: str, key: str, model: str) -> tuple[int, str]:
    response = call(url, key, "POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                          "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["text"]


def test_an_adapter_reloaded_with_other_weights_under_the_same_name_and_path_reuses_no_cached_kv(
        served, adapter_dirs, two_trust_groups, tmp_path):
    key = two_trust_groups.a_key
    swapped = shutil.copytree(adapter_dirs["first"], tmp_path / "swapped")
    assert load(served, key, "reloaded", swapped).status_code == 200
    cached_tokens(served, key, "reloaded")
    assert cached_tokens(served, key, "reloaded")[0] > 0  # its blocks are cached
    assert unload(served, key, "reloaded").status_code == 200
    shutil.copy(adapter_dirs["second"] / WEIGHTS, swapped / WEIGHTS)  # other weights, same name, same path
    with loaded(served, key, "reloaded", swapped), loaded(served, key, "fresh", adapter_dirs["second"]):
        reused, text = cached_tokens(served, key, "reloaded")
        assert reused == 0  # no block the old weights computed
        assert text == cached_tokens(served, key, "fresh")[1]


@pytest.mark.parametrize("damage, words", [
    (lambda t: t.to(torch.int64), "int64"),
    (lambda t: t.to(torch.bool), "bool"),
    (lambda t: t.index_fill(1, torch.tensor([0]), float("nan")), "NaN"),
    (lambda t: t.index_fill(1, torch.tensor([1]), float("inf")), "inf"),
    (lambda t: t.index_fill(1, torch.tensor([1]), float("-inf")), "inf"),
], ids=["int64", "bool", "nan", "inf", "minus-inf"])
def test_weights_that_are_not_finite_floats_are_a_400_naming_the_tensor(served, adapter_dirs, two_trust_groups,
                                                                        tmp_path, damage, words):
    key = two_trust_groups.a_key
    broken = shutil.copytree(adapter_dirs["first"], tmp_path / "broken")
    tensors = load_file(broken / WEIGHTS)
    victim = sorted(name for name in tensors if "lora_B" in name)[0]
    tensors[victim] = damage(tensors[victim]).contiguous()
    save_file(tensors, broken / WEIGHTS)
    response = load(served, key, "broken", broken)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and victim in error["message"] and words in error["message"], error
    assert "broken" not in {card["id"] for card in listed(served, key)}
    assert complete(served, key, "at-start").status_code == 200
