"""LoRA adapters through the server and the openai client: the ``model`` field picks the adapter,
``/v1/models`` lists adapters under their base model, adapters load and unload at run time (behind
the key, refused while busy), a bad adapter is a 400 that lists nothing, and two adapters never
share cached prompt blocks."""

from __future__ import annotations

import pytest
import requests
from openai import NotFoundError, OpenAI

from shared import SamplingParams
from stage5_server import LLM, LoRARequest
from stage5_server.server import create_app
from tests.stage5.lora_adapters import make_adapter
from tests.stage5.server_fixtures import auth, make_llm, metric, running_server, wait_until

KEY = "lora-key"
BASE = "tiny-base"
ENGINE = dict(device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              enable_prefix_caching=True)
PROMPT = "blocks of a few tokens, found through a table, waste at most one partial block"


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-adapters")
    paths = {"every": make_adapter(tiny_llama, root / "every", seed=1),
             "q-v": make_adapter(tiny_llama, root / "q-v", seed=2, r=4, alpha=8, target_modules=("q_proj", "v_proj")),
             "rank-16": make_adapter(tiny_llama, root / "rank-16", seed=3, r=16)}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        app = create_app(make_llm(tiny_llama, **ENGINE), api_keys=[KEY], served_model_name=BASE,
                         lora_modules=[("every", str(paths["every"]))])
    with running_server(app) as server:
        yield {"url": server.url, "paths": paths, "model": tiny_llama}


@pytest.fixture()
def client(served):
    with OpenAI(base_url=f"{served['url']}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def complete(client, model: str, prompt: str = "def add(a, b):", max_tokens: int = 6):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


def post(served, route: str, body: dict, key: str | None = KEY):
    return requests.post(f"{served['url']}{route}", json=body, headers=auth(key) if key else {}, timeout=60)


def test_the_model_field_picks_the_adapter_and_its_tokens_are_the_offline_engines(served, client):
    offline = LLM(str(served["model"]), max_model_len=256, **ENGINE)
    every = LoRARequest("every", 1, str(served["paths"]["every"]))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected_lora = offline.generate(["def add(a, b):"], params, use_tqdm=False, lora_request=every)[0]
    expected_base = offline.generate(["def add(a, b):"], params, use_tqdm=False)[0]
    assert expected_lora.outputs[0].text != expected_base.outputs[0].text
    got = complete(client, "every")
    assert got.model == "every"
    assert got.choices[0].text == expected_lora.outputs[0].text
    assert complete(client, BASE).choices[0].text == expected_base.outputs[0].text
    chat = client.chat.completions.create(model="every", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0)
    assert chat.model == "every" and chat.choices[0].message.content is not None


def test_models_lists_each_adapter_with_the_base_model_as_parent_and_its_name_as_root(served, client):
    cards = {m.id: m for m in client.models.list().data}
    assert cards[BASE].parent is None
    assert cards["every"].parent == BASE
    assert cards["every"].root == "every"  # never its path on the server
    assert client.models.retrieve("every").id == "every"


def test_an_unknown_model_is_a_404_model_not_found(client):
    with pytest.raises(NotFoundError) as caught:
        complete(client, "no-such-adapter")
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.body["param"] == "model"


def test_adapters_load_and_unload_at_run_time_behind_the_key(served, client):
    body = {"lora_name": "q-v", "lora_path": str(served["paths"]["q-v"])}
    assert post(served, "/v1/load_lora_adapter", body, key=None).status_code == 401
    loaded = post(served, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert "q-v" in {m.id for m in client.models.list().data}
    assert complete(client, "q-v").choices[0].text != complete(client, BASE).choices[0].text
    again = post(served, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_already_loaded"
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "q-v"}).status_code == 200
    assert "q-v" not in {m.id for m in client.models.list().data}
    with pytest.raises(NotFoundError):
        complete(client, "q-v")
    gone = post(served, "/v1/unload_lora_adapter", {"lora_name": "q-v"})
    assert gone.status_code == 404


def test_a_bad_adapter_is_a_400_at_load_and_nothing_is_listed(served, client, tmp_path):
    too_big = post(served, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(served["paths"]["rank-16"])})
    assert too_big.status_code == 400
    assert "rank 16 is above max_lora_rank=8" in too_big.json()["error"]["message"]
    missing = post(served, "/v1/load_lora_adapter", {"lora_name": "none", "lora_path": str(tmp_path)})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    names = {m.id for m in client.models.list().data}
    assert "big" not in names and "none" not in names
    with pytest.raises(NotFoundError):
        complete(client, "big")


def test_a_busy_adapter_is_not_unloaded_under_its_requests(served, client):
    stream = client.completions.create(model="every", prompt="x", max_tokens=120, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # in flight
    refused = post(served, "/v1/unload_lora_adapter", {"lora_name": "every"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "lora_in_use"
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert text  # it ran to the end under its adapter
    assert "every" in {m.id for m in client.models.list().data}


def test_the_same_prompt_shares_cached_blocks_under_one_adapter_and_none_across_adapters(served, client):
    def hits() -> float:
        text = requests.get(f"{served['url']}/metrics", headers=auth(KEY), timeout=30).text
        return metric(text, "vllm:prefix_cache_hits_total") or 0.0

    def cached(model: str) -> int:
        before = hits()
        usage = complete(client, model, prompt=PROMPT, max_tokens=1).usage
        tokens = usage.prompt_tokens_details.cached_tokens
        assert wait_until(lambda: hits() - before == tokens, timeout=5), (hits() - before, tokens)  # /metrics agrees
        return tokens

    assert cached("every") == 0
    assert cached("every") > 0  # the same adapter: the prompt's blocks again
    assert cached(BASE) == 0  # the base model: none of the adapter's


def test_an_adapter_loads_while_requests_run_and_both_finish(served, client):
    stream = client.completions.create(model="every", prompt="x", max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # in flight
    body = {"lora_name": "q-v-late", "lora_path": str(served["paths"]["q-v"])}
    assert post(served, "/v1/load_lora_adapter", body).status_code == 200
    assert complete(client, "q-v-late").choices[0].text
    assert "".join(chunk.choices[0].text for chunk in stream)
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "q-v-late"}).status_code == 200


def test_a_bad_load_body_is_a_400(served):
    assert post(served, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
