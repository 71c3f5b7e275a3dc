"""Runtime adapter loading probed as an attacker or a careless client would: paths out of the adapter
root (``..``, absolute, a symbolic link), loading without the key or with the runtime switch off, names
that collide or hold whitespace, control characters, special-token text or 10k characters, adapters of
the wrong rank or shape, corrupt safetensors, a missing or malformed adapter_config.json, and an
unload under a request in flight. Each is a 4xx OpenAI error object naming the field, nothing is
listed after a failed load, and the server serves the next request. An adapter whose files are deleted
once it is loaded serves the same tokens: in several engine modes, in the offline ``LLM``, and behind two
API servers when the other unloads its own. The tiny Llama, the real server, adapters made with PEFT."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import requests

from stage5_server.server import create_app
from tests.reliability.modes import make_engine, mode_params, shutdown
from tests.stage5.lora_adapters import make_adapter
from tests.stage5.server_fixtures import auth, make_llm, running_server

KEY = "lora-probe-key"
BASE = "tiny-base"
ENGINE = dict(device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-root")
    outside = tmp_path_factory.mktemp("outside-root")
    good = make_adapter(tiny_llama, root / "good", seed=1, r=4, target_modules=("q_proj", "v_proj"))
    make_adapter(tiny_llama, root / "rank-16", seed=2, r=16, target_modules=("q_proj",))
    shutil.copytree(good, outside / "elsewhere")
    (root / "link-out").symlink_to(outside / "elsewhere", target_is_directory=True)
    broken = {  # name -> (what to do to a copy of the good adapter)
        "no-config": lambda d: (d / "adapter_config.json").unlink(),
        "no-weights": lambda d: (d / "adapter_model.safetensors").unlink(),
        "config-a-list": lambda d: (d / "adapter_config.json").write_text("[1, 2]"),
        "config-not-json": lambda d: (d / "adapter_config.json").write_text("{r: 4"),
        "rank-a-string": lambda d: _edit_config(d, r="4"),
        "rank-zero": lambda d: _edit_config(d, r=0),
        "rank-huge": lambda d: _edit_config(d, r=10 ** 12),
        "rank-mismatch": lambda d: _edit_config(d, r=2),
        "alpha-a-string": lambda d: _edit_config(d, lora_alpha="x"),
        "embed-target": lambda d: _edit_config(d, target_modules=["embed_tokens"]),
        "dora": lambda d: _edit_config(d, use_dora=True),
        "prefix-tuning": lambda d: _edit_config(d, peft_type="PREFIX_TUNING"),
        "random-bytes": lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x13\x37" * 1000),
        "empty-weights": lambda d: (d / "adapter_model.safetensors").write_bytes(b""),
        "huge-header": lambda d: (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2 ** 62) + b"{}"),
        "truncated": lambda d: _truncate(d / "adapter_model.safetensors"),
        "lying-shape": lambda d: _lying_shape(d / "adapter_model.safetensors"),
    }
    for name, damage in broken.items():
        shutil.copytree(good, root / name)
        damage(root / name)
    return {"root": root, "outside": outside, "broken": sorted(broken)}


def _edit_config(directory, **fields):
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _lying_shape(path):
    """A header naming a tensor of 2**40 x 2**40 floats over a few bytes of data."""
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                         {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)


@pytest.fixture(scope="module")
def served(tiny_llama, adapters):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        app = create_app(make_llm(tiny_llama, **ENGINE), api_keys=[KEY], served_model_name=BASE,
                         lora_modules=[("listed", str(adapters["root"] / "good"))])
    with running_server(app) as server:
        yield server.url


@pytest.fixture
def rooted(monkeypatch, adapters):
    monkeypatch.setenv("STAGEDSERVE_LORA_ADAPTER_ROOT", str(adapters["root"]))


def post(url: str, route: str, body: dict, key: str | None = KEY) -> requests.Response:
    return requests.post(f"{url}{route}", json=body, headers=auth(key) if key else {}, timeout=60)


def load(url: str, name: str, path: str) -> requests.Response:
    return post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def client_error(response: requests.Response, param: str, words: str = "", status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "Traceback" not in response.text
    return error


def listed(url: str) -> set[str]:
    return {m["id"] for m in requests.get(f"{url}/v1/models", headers=auth(KEY), timeout=30).json()["data"]}


def completes(url: str, model: str = BASE) -> str:
    response = post(url, "/v1/completions", {"model": model, "prompt": "def f(x):", "max_tokens": 4,
                                             "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


# ---- where an adapter may come from ------------------------------------------------------------------

@pytest.mark.parametrize("path", ["../outside-root/elsewhere", "{outside}/elsewhere", "link-out", "good/../../",
                                  "/etc", "/proc/self", "good\0/x", "{root}/../outside-root/elsewhere"])
def test_a_runtime_load_reads_only_under_the_adapter_root(served, adapters, rooted, path):
    path = path.format(root=adapters["root"], outside=adapters["outside"])
    if path.startswith("../"):
        path = str(adapters["root"] / path)[len(str(adapters["root"])) + 1:]  # relative to the root
    client_error(load(served, "escaped", path), "lora_path", "outside the directory")
    assert "escaped" not in listed(served)


def test_inside_the_root_a_relative_or_absolute_path_loads(served, adapters, rooted):
    for name, path in (("relative", "good"), ("absolute", str(adapters["root"] / "good"))):
        assert load(served, name, path).status_code == 200
        assert completes(served, name) == completes(served, "listed")
        assert post(served, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_without_a_root_a_missing_directory_is_a_400_that_names_no_file_contents(served):
    for path in ("/etc", "/etc/passwd", "/nonexistent", "", "\0"):
        error = client_error(load(served, "nowhere", path), "lora_path", "holds no adapter_config.json")
        assert "root:" not in error["message"]


def test_the_load_routes_need_the_key_and_the_runtime_switch(served, adapters, tiny_llama):
    body = {"lora_name": "k", "lora_path": str(adapters["root"] / "good")}
    for key in (None, "wrong", KEY.upper()):
        assert post(served, "/v1/load_lora_adapter", body, key=key).status_code == 401
        assert post(served, "/v1/unload_lora_adapter", {"lora_name": "listed"}, key=key).status_code == 401
    switched_off = create_app(make_llm(tiny_llama, **ENGINE), api_keys=[KEY], served_model_name=BASE)
    with running_server(switched_off) as server:
        missing = post(server.url, "/v1/load_lora_adapter", body)
        assert missing.status_code == 404 and missing.json()["error"]["message"], missing.text
        assert "k" not in listed(server.url)


# ---- names ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", " ", "two words", "tab\there", "new\nline", "nul\0", "bell\x07", "x" * 10_000,
                                  BASE, " listed"])
def test_a_bad_adapter_name_is_a_400(served, adapters, name):
    error = client_error(load(served, name, str(adapters["root"] / "good")), "lora_name", "cannot name an adapter")
    assert len(error["message"]) < 500
    assert name not in listed(served) or name == BASE


def test_a_name_taken_by_another_adapter_is_a_400_and_the_first_keeps_its_weights(served, adapters):
    before = completes(served, "listed")
    error = client_error(load(served, "listed", str(adapters["root"] / "rank-mismatch")), "lora_name")
    assert error["code"] == "lora_already_loaded"
    assert completes(served, "listed") == before


@pytest.mark.parametrize("name", ["<|im_end|>", "</s>", "<|endoftext|>", "[INST]", "ünïcödé-✓"])
def test_special_token_text_in_a_name_is_only_a_name(served, adapters, name):
    assert load(served, name, str(adapters["root"] / "good")).status_code == 200
    assert completes(served, name) == completes(served, "listed")  # the name never reaches the prompt
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


# ---- what an adapter holds -------------------------------------------------------------------------------

def test_every_broken_adapter_is_a_400_and_nothing_is_listed(served, adapters):
    for name in ["rank-16", *adapters["broken"]]:
        response = load(served, f"b-{name}", str(adapters["root"] / name))
        client_error(response, "lora_path")
        assert f"b-{name}" not in listed(served), name
    assert completes(served, "listed")


# ---- unloading under load -----------------------------------------------------------------------------

def test_an_unload_under_a_request_in_flight_is_refused_and_the_request_finishes(served, adapters):
    assert load(served, "busy", str(adapters["root"] / "good")).status_code == 200
    body = {"model": "busy", "prompt": "x", "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
    with requests.post(f"{served}/v1/completions", json=body, headers=auth(KEY), stream=True, timeout=120) as stream:
        lines = stream.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line).startswith("data: ")  # in flight
        refused = post(served, "/v1/unload_lora_adapter", {"lora_name": "busy"})
        client_error(refused, "lora_name", "in flight")
        assert refused.json()["error"]["code"] == "lora_in_use"
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    assert "busy" not in listed(served)
    assert completes(served)


def test_an_unload_between_a_requests_admission_and_its_engine_requests_cannot_strand_it(tiny_llama, adapters):
    """A request admitted with an adapter holds it while its engine requests are made (tokenizing, fetching
    images): an unload meanwhile is refused as busy, and a request admitted before an unload that went
    through is a 404, never sent to workers whose copy of the weights is gone."""
    from stage5_server.server.errors import APIError

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        app = create_app(make_llm(tiny_llama, **ENGINE), api_keys=[KEY], served_model_name=BASE,
                         lora_modules=[("held", str(adapters["root"] / "good"))])
    models = app.state.serving.models
    with running_server(app) as server:
        admitted = models.resolve("held", "key#1")
        with models.send(admitted):
            client_error(post(server.url, "/v1/unload_lora_adapter", {"lora_name": "held"}), "lora_name", "in flight")
        assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": "held"}).status_code == 200
        with pytest.raises(APIError) as gone, models.send(admitted):
            pass
        assert gone.value.status == 404
        assert completes(server.url)


# ---- files deleted once loaded ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", mode_params("adapter-files", ("in-process", "engine-process", "dp2", "tp2", "ray-tp2"),
                                             slow=("dp2",)))
def test_an_adapter_whose_files_are_deleted_once_loaded_serves_the_same_tokens(tiny_llama, tmp_path, mode):
    """The weights checked at load are the weights served: deleting the files of an adapter listed at start-up
    or loaded at run time changes nothing (before, its requests failed with a 500 ``engine_error``)."""
    twin = make_adapter(tiny_llama, tmp_path / "twin", seed=3, r=4, target_modules=("q_proj", "v_proj"))
    at_start, at_run = shutil.copytree(twin, tmp_path / "at-start"), shutil.copytree(twin, tmp_path / "at-run")
    engine = make_engine(mode, tiny_llama, **{k: v for k, v in ENGINE.items() if k not in ("device", "dtype")})
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            app = create_app(engine, api_keys=[KEY], served_model_name=BASE, lora_modules=[("at-start", str(at_start))])
        with running_server(app) as server:
            assert load(server.url, "at-run", str(at_run)).status_code == 200
            assert load(server.url, "twin", str(twin)).status_code == 200
            expected, base = completes(server.url, "twin"), completes(server.url)
            assert expected != base  # the adapter reaches the forward pass
            shutil.rmtree(at_start)
            shutil.rmtree(at_run)
            assert completes(server.url, "at-start") == completes(server.url, "at-run") == expected
            assert completes(server.url) == base
            for name in ("at-start", "at-run"):
                assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
            assert listed(server.url) == {BASE, "twin"}
    finally:
        shutdown(engine)


def test_offline_an_adapter_whose_files_are_deleted_after_its_request_was_added_runs_on_the_checked_weights(
        tiny_llama, tmp_path):
    """The offline ``LLM`` hands the weights it checked to the workers too: deleting the files between
    ``add_request`` and the steps changes nothing (before, the workers read the files at the first step
    and failed it); ``remove_lora`` drops the copy, after which the gone files are a load error again."""
    from shared.sampling_params import SamplingParams
    from stage5_server.lora import LoRALoadError, LoRARequest

    twin = make_adapter(tiny_llama, tmp_path / "twin", seed=3, r=4, target_modules=("q_proj", "v_proj"))
    doomed = shutil.copytree(twin, tmp_path / "doomed")
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(["def f(x):"], params, use_tqdm=False, lora_request=LoRARequest("twin", 1, str(twin)))
    base = llm.generate(["def f(x):"], params, use_tqdm=False)
    assert expected[0].outputs[0].token_ids != base[0].outputs[0].token_ids  # the adapter reaches the forward

    doomed_request = LoRARequest("doomed", 2, str(doomed))
    llm.add_request("def f(x):", params, request_id="after-delete", lora_request=doomed_request)
    shutil.rmtree(doomed)
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({out.request_id: out for out in llm.step() if out.finished})
    assert finished["after-delete"].outputs[0].token_ids == expected[0].outputs[0].token_ids

    assert llm.remove_lora(2) and not llm.remove_lora(2)
    with pytest.raises(LoRALoadError):  # its copy is gone and so are its files: refused before anything is queued
        llm.generate(["def f(x):"], params, use_tqdm=False, lora_request=doomed_request)
    assert not llm.has_unfinished_requests()
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.xdist_group("adapter-two-api-servers")
def test_two_api_servers_over_one_engine_core_never_drop_each_others_adapters(tiny_llama, tmp_path):
    """Two API servers over the same engine core (``--api-server-count 2``) each load an adapter at run time;
    one unloads its own, the other's files are deleted, and the other still serves it (before, both loads
    got ``lora_int_id`` 1, so the unload dropped the workers' copy of both and the other's next request
    read deleted files: a 500)."""
    import dataclasses

    from stage5_server.engine.mp_client import MPAsyncLLM
    from tests.stage5.server_fixtures import ENGINE_KWARGS

    first_dir = make_adapter(tiny_llama, tmp_path / "first", seed=3, r=4, target_modules=("q_proj", "v_proj"))
    second_dir = shutil.copytree(first_dir, tmp_path / "second")
    one_slot = {**{k: v for k, v in ENGINE.items() if k not in ("device", "dtype")}, "max_loras": 1}
    owner = MPAsyncLLM(str(tiny_llama), log_stats_interval=None, startup_timeout_s=300,
                       **{**ENGINE_KWARGS, **one_slot})  # one slot: "second" must come from a copy each time
    topology = dataclasses.replace(owner.topology, api_server_count=3)  # API servers 1 and 2 (0 only starts it)
    engines = [MPAsyncLLM.connect(topology, client_index=i, log_stats_interval=None) for i in (1, 2)]
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            apps = [create_app(engine, api_keys=[KEY], served_model_name=BASE) for engine in engines]
        with running_server(apps[0]) as one, running_server(apps[1]) as two:
            assert load(one.url, "first", str(first_dir)).status_code == 200
            assert load(two.url, "second", str(second_dir)).status_code == 200
            expected = completes(two.url, "second")
            assert expected == completes(one.url, "first") != completes(two.url)
            assert post(one.url, "/v1/unload_lora_adapter", {"lora_name": "first"}).status_code == 200  # in the slot
            shutil.rmtree(second_dir)
            assert completes(two.url, "second") == expected
    finally:
        for engine in engines:
            engine.shutdown()
        owner.shutdown()
