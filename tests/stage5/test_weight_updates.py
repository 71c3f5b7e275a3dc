"""Serving while training (``stage5_server/weight_sync/``): after a weight update, in-process, from a
checkpoint directory or broadcast by a trainer process over gloo, the engine's greedy tokens are
transformers' on the new weights; no prefix-cache hit crosses an update; a request in flight when an
update arrives finishes on the old weights and one sent meanwhile runs on the new; sleep refuses
requests cleanly and wake serves the same tokens again; the dev routes are 404 unless switched on
and need the key. All of it only with ``enable_weight_sync=True``: off, a weight call names the switch and
nothing of the room is loaded.
"""

from __future__ import annotations

import multiprocessing
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from shared import SamplingParams
from stage5_server import LLM
from stage5_server.engine.thread_client import AsyncLLM
from stage5_server.server import create_app
from stage5_server.weight_sync import EngineSleepingError, WeightBroadcaster, describe_tensors
from tests.stage5.server_fixtures import ENGINE_KWARGS, REPO, auth, make_llm, metric, running_server, wait_until

PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11]]  # 37 tokens: two full 16-token blocks for the prefix cache
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KEY = "dev-key"
SYNC = {"enable_weight_sync": True}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_tokens(model, prompts=PROMPTS, max_new_tokens: int = 12) -> list[list[int]]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        out.append(tokens[0, len(ids):].tolist())
    return out


def engine_tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def nudged(model, seed: int = 1, scale: float = 0.02):
    """``model`` with seeded noise added to every weight: a stand-in for a training step."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """(transformers model, checkpoint directory) of the tiny model after a nudge."""
    model = nudged(hf_model(tiny_llama))
    path = tmp_path_factory.mktemp("trained") / "model"
    shutil.copytree(tiny_llama, path)  # the tokenizer and config; the weights replaced below
    for old in path.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def references(tiny_llama, trained):
    """transformers' greedy tokens on the original and on the trained weights."""
    return hf_tokens(hf_model(tiny_llama)), hf_tokens(trained[0])


@pytest.fixture(scope="module", autouse=True)
def weight_sync_secret():
    """The secret a trainer and the workers share (``weight_sync/store.py``): set for this process and every
    process it starts, trainers and workers alike."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STAGEDSERVE_WEIGHT_SYNC_SECRET", secrets.token_hex(32))
        yield


@pytest.fixture
def llm(tiny_llama):
    engine = make_llm(tiny_llama, **SYNC)
    yield engine
    engine.shutdown()


# ---- off -------------------------------------------------------------------------------------------


def test_without_weight_sync_a_weight_call_names_the_switch_and_the_core_rpc_still_works(tiny_llama):
    llm = make_llm(tiny_llama)
    try:
        assert llm.engine.weight_sync is None and llm.weight_version == 0
        for call in (lambda: llm.sleep(), lambda: llm.update_weights([]), lambda: llm.wake_up()):
            with pytest.raises(ValueError, match="enable_weight_sync=True"):
                call()
        with pytest.raises(ValueError, match="no method 'update_weights'"):  # no extension beside the worker
            llm.collective_rpc("update_weights", args=([],))
        assert [d["rank"] for d in llm.collective_rpc("describe")] == [0]  # the core's own utility
    finally:
        llm.shutdown()


def test_without_weight_sync_nothing_of_its_room_is_imported(tiny_llama):
    code = ("import sys; from tests.stage5.server_fixtures import make_llm; "
            f"llm = make_llm({str(tiny_llama)!r}); llm.generate([[7, 8, 9]], use_tqdm=False); "
            "llm.collective_rpc('describe'); "
            "print(sorted(m for m in sys.modules if m.startswith('stage5_server.weight_sync')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ---- collective_rpc --------------------------------------------------------------------------------


def rank_and_offset(worker, offset: int = 0, *, scale: int = 1) -> int:
    return (worker.rank + offset) * scale


def test_collective_rpc_returns_each_workers_result_and_names_an_unknown_method(llm):
    assert [d["rank"] for d in llm.collective_rpc("describe")] == [0]
    assert llm.collective_rpc(rank_and_offset, args=(3,), kwargs={"scale": 2}) == [6]
    with pytest.raises(ValueError, match="no method 'no_such_method'"):
        llm.collective_rpc("no_such_method")
    with pytest.raises(ValueError, match="no method '_weight_loader'"):
        llm.collective_rpc("_weight_loader")
    with pytest.raises(ValueError, match="run by the engine core itself"):  # the core keeps the KV pool's state
        llm.collective_rpc("sleep", args=(1,))
    with pytest.raises(ValueError, match="model.bogus"):  # a worker's ValueError comes back; the engine lives on
        llm.collective_rpc(update_behind_the_cores_back, args=([("model.bogus", torch.zeros(1))],))
    assert engine_tokens(llm)  # still serving


def update_behind_the_cores_back(worker, named_tensors):
    """A function run on the worker (only the offline caller's own code can be one): the worker's weight method
    without the core's drain, reset and version."""
    return worker.extension.update_weights(named_tensors)


def test_a_weight_method_by_name_is_refused_through_collective_rpc(llm, trained):
    for method, args in (("update_weights", ([],)), ("update_weights_from_path", (str(trained[1]),)),
                         ("update_weights_from_distributed", ([],)), ("shutdown", ())):
        with pytest.raises(ValueError, match="run by the engine core itself"):
            llm.collective_rpc(method, args=args)
    assert llm.weight_version == 0


def slow_method(worker, seconds: float) -> int:
    time.sleep(seconds)
    return worker.rank


def test_collective_rpc_gives_up_waiting_after_its_timeout(llm):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer within 0.2 s"):
        llm.collective_rpc(slow_method, args=(1.0,), timeout=0.2)
    assert time.monotonic() - started < 0.9
    time.sleep(1.0)  # the call itself ran on
    assert llm.collective_rpc(slow_method, args=(0.0,), timeout=5) == [0]


# ---- updates ---------------------------------------------------------------------------------------


def test_an_in_process_update_gives_transformers_tokens_on_the_new_weights(llm, trained, references):
    before, after = references
    assert engine_tokens(llm) == before
    assert before != after  # the nudge changed the greedy tokens
    assert llm.update_weights(trained[0].state_dict().items()) == 1
    assert engine_tokens(llm) == after
    assert llm.weight_version == 1


def test_an_update_from_a_checkpoint_directory_and_back(llm, tiny_llama, trained, references):
    before, after = references
    assert llm.update_weights_from_path(str(trained[1])) == 1
    assert engine_tokens(llm) == after
    assert llm.reload_weights() == 2  # the served checkpoint again
    assert engine_tokens(llm) == before


def test_the_worker_method_run_as_a_function_loads_the_same_weights(llm, trained, references):
    counts = llm.collective_rpc(update_behind_the_cores_back, args=(list(trained[0].state_dict().items()),))
    assert counts[0] > 0
    llm.reset_prefix_cache()
    assert engine_tokens(llm) == references[1]


def test_a_bad_update_is_refused_before_anything_is_written(llm, references):
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        llm.update_weights_from_path("/no/such/dir")
    assert llm.weight_version == 0
    assert engine_tokens(llm) == references[0]


def test_no_prefix_cache_hit_crosses_an_update(llm, trained, references):
    engine_tokens(llm, PROMPTS[:1])
    hits = llm.engine.stats().prefix_cache_hits
    engine_tokens(llm, PROMPTS[:1])
    cached = llm.engine.stats().prefix_cache_hits
    assert cached >= hits + 32  # the two full blocks hit
    llm.update_weights_from_path(str(trained[1]))
    assert engine_tokens(llm, PROMPTS[:1]) == references[1][:1]
    assert llm.engine.stats().prefix_cache_hits == cached  # recomputed: no KV of the old weights reused


def test_without_the_reset_the_stale_prefix_gives_other_tokens(llm, trained, references):
    """What the reset prevents: the worker method alone swaps the weights but leaves the cached blocks."""
    engine_tokens(llm, PROMPTS[:1])
    llm.collective_rpc(update_behind_the_cores_back, args=(list(trained[0].state_dict().items()),))
    stale = engine_tokens(llm, PROMPTS[:1])
    assert stale != references[1][:1]
    llm.reset_prefix_cache()
    assert engine_tokens(llm, PROMPTS[:1]) == references[1][:1]


def test_an_offline_update_is_refused_while_requests_are_unfinished(llm, trained):
    llm.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.update_weights_from_path(str(trained[1]))
    assert llm.weight_version == 0


@pytest.mark.parametrize("linear", [dict(prepack_linear=True), dict(quantization="int8")])
def test_packed_and_quantized_layers_are_processed_again(tiny_llama, trained, linear):
    updated = make_llm(tiny_llama, **linear, **SYNC)
    fresh = make_llm(trained[1], **linear)  # the same method over the trained checkpoint, loaded from scratch
    try:
        updated.update_weights(trained[0].state_dict().items())
        assert engine_tokens(updated) == engine_tokens(fresh)
        with pytest.raises(ValueError, match="in one update"):  # a processed layer keeps no plain rows
            updated.update_weights([("model.layers.0.self_attn.q_proj.weight",
                                     trained[0].model.layers[0].self_attn.q_proj.weight)])
        updated.sleep(level=2)  # the processed copies dropped too, and made again from the reloaded weights
        assert updated.collective_rpc("weight_bytes") == [0]
        updated.wake_up()
        updated.update_weights_from_path(str(trained[1]))
        assert engine_tokens(updated) == engine_tokens(fresh)
    finally:
        updated.shutdown()
        fresh.shutdown()


def test_lora_adapters_stay_loaded_across_an_update(tiny_llama, trained, tmp_path):
    from stage5_server.lora import LoRARequest
    from tests.stage5.lora_adapters import make_adapter

    adapter = LoRARequest("a", 1, str(make_adapter(tiny_llama, tmp_path / "a", seed=3)))
    llm = make_llm(tiny_llama, enable_lora=True, max_lora_rank=8, **SYNC)
    fresh = make_llm(trained[1], enable_lora=True, max_lora_rank=8)
    try:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter)  # the adapter is in its slot
        llm.update_weights_from_path(str(trained[1]))
        with_adapter = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter)
        expected = fresh.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter)
        assert [o.outputs[0].token_ids for o in with_adapter] == [o.outputs[0].token_ids for o in expected]
    finally:
        llm.shutdown()
        fresh.shutdown()


# ---- from a trainer process over gloo --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_main(path: str, port: int, world_size: int) -> None:
    """A trainer process: its weights, broadcast to the engine's workers (rank 0 of their group)."""
    model = hf_model(path)
    WeightBroadcaster("127.0.0.1", port, world_size).send(model.state_dict().items())


def push_from_trainer(llm: LLM, trained, num_workers: int = 1) -> int:
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=trainer_main,
                                                           args=(str(trained[1]), port, 1 + num_workers))
    trainer.start()
    try:
        assert llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", port, 1, 1 + num_workers)) == \
            list(range(1, 1 + num_workers))
        version = llm.update_weights_from_distributed(describe_tensors(trained[0].state_dict().items()))
        trainer.join(60)
        assert trainer.exitcode == 0
        return version
    finally:
        if trainer.is_alive():
            trainer.kill()


@pytest.mark.slow
def test_an_update_broadcast_by_a_trainer_process_over_gloo(llm, trained, references):
    assert push_from_trainer(llm, trained) == 1
    assert engine_tokens(llm) == references[1]


SPLIT_KWARGS = dict(max_model_len=256, max_num_seqs=8, block_size=16, device="cpu", attention_backend="torch",
                    kv_cache_memory=1 << 20)


@pytest.mark.slow
@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_a_split_model_takes_updates_rank_by_rank(tiny_llama, trained, references, split):
    llm = LLM(str(tiny_llama), **SPLIT_KWARGS, **split, **SYNC)
    try:
        assert len(llm.collective_rpc("describe")) == 2
        assert engine_tokens(llm) == references[0]
        llm.update_weights(trained[0].state_dict().items())  # each rank takes its shard / its stage's layers
        assert engine_tokens(llm) == references[1]
        llm.reload_weights()
        assert engine_tokens(llm) == references[0]
        push_from_trainer(llm, trained, num_workers=2)
        assert engine_tokens(llm) == references[1]
    finally:
        llm.shutdown()


# ---- sleep -----------------------------------------------------------------------------------------


def test_sleep_level_1_frees_the_kv_cache_and_wake_serves_the_same_tokens(llm, references):
    assert llm.collective_rpc("kv_cache_bytes")[0] > 0
    freed = llm.sleep(level=1)
    assert freed > 0 and llm.is_sleeping()
    assert llm.collective_rpc("kv_cache_bytes") == [0]
    with pytest.raises(EngineSleepingError, match="sleeping"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.wake_up() and not llm.is_sleeping()
    assert engine_tokens(llm) == references[0]


def test_sleep_level_2_frees_the_weights_which_an_update_brings_back(llm, trained, references):
    weights = llm.collective_rpc("weight_bytes")[0]
    llm.sleep(level=2)
    assert llm.collective_rpc("weight_bytes") == [0]
    llm.wake_up()
    with pytest.raises(EngineSleepingError, match="no weights"):  # level 2: weights first
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.update_weights_from_path(str(trained[1]))
    assert llm.collective_rpc("weight_bytes") == [weights]
    assert engine_tokens(llm) == references[1]
    llm.reload_weights()
    assert engine_tokens(llm) == references[0]


# ---- the server ------------------------------------------------------------------------------------


def test_dev_routes_are_404_unless_switched_on_and_need_the_key(tiny_llama):
    engine = AsyncLLM.from_llm(make_llm(tiny_llama, **SYNC), log_stats_interval=None)
    try:
        with running_server(create_app(engine, api_keys=[KEY])) as server:
            for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                                 ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"),
                                 ("POST", "/update_weights")]:
                assert httpx.request(method, server.url + path, headers=auth(KEY)).status_code == 404
            schema = httpx.get(server.url + "/openapi.json", headers=auth(KEY)).json()
            assert "/sleep" not in schema["paths"]
        with running_server(create_app(engine, api_keys=[KEY], enable_dev_routes=True)) as server:
            assert httpx.get(server.url + "/is_sleeping").status_code == 401
            assert httpx.post(server.url + "/sleep").status_code == 401
            response = httpx.get(server.url + "/is_sleeping", headers=auth(KEY))
            assert response.json() == {"is_sleeping": False}
            rpc = httpx.post(server.url + "/collective_rpc", headers=auth(KEY), json={"method": "describe"})
            assert rpc.status_code == 200 and rpc.json()["results"][0]["rank"] == 0
            bad = httpx.post(server.url + "/collective_rpc", headers=auth(KEY), json={"method": "nope"})
            assert bad.status_code == 400 and "no method 'nope'" in bad.json()["error"]["message"]
            bad = httpx.post(server.url + "/collective_rpc", headers=auth(KEY),
                             json={"method": "update_weights", "args": [[["model.norm.weight", [1.0]]]]})
            assert bad.status_code == 400  # the caller's arguments: a 400, and the engine is as it was
            bad = httpx.post(server.url + "/update_weights", headers=auth(KEY), json={"path": "/no/such"})
            assert bad.status_code == 400
            bad = httpx.post(server.url + "/update_weights", headers=auth(KEY), json={"path": "/x", "reload": True})
            assert bad.status_code == 400
            assert httpx.post(server.url + "/update_weights", headers=auth(KEY), content=b"{").status_code == 400
            assert httpx.post(server.url + "/sleep?level=3", headers=auth(KEY)).status_code == 400
    finally:
        engine.shutdown()


def completion(url: str, prompt, max_tokens: int = 12, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=auth(KEY), timeout=60,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            **extra})


def test_a_request_spanning_an_update_finishes_on_the_old_weights(tiny_llama, trained):
    """The update waits for the request in flight; a request sent while it waits runs on the new weights."""
    long_params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    old_text = make_llm(tiny_llama).generate([PROMPTS[0]], long_params, use_tqdm=False)[0].outputs[0].text
    new_text = make_llm(trained[1]).generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].text
    old_short = make_llm(tiny_llama).generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert new_text != old_short
    engine = AsyncLLM.from_llm(make_llm(tiny_llama, **SYNC), log_stats_interval=None)
    try:
        with running_server(create_app(engine, api_keys=[KEY], enable_dev_routes=True)) as server:
            chunks, results = [], {}
            first = threading.Event()

            def stream() -> None:
                with httpx.stream("POST", server.url + "/v1/completions", headers=auth(KEY), timeout=60,
                                  json={"prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0,
                                        "ignore_eos": True, "stream": True}) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            chunks.append(httpx.Response(200, content=line[6:]).json())
                            first.set()

            def update() -> None:
                results["update"] = httpx.post(server.url + "/update_weights", headers=auth(KEY), timeout=60,
                                               json={"path": str(trained[1])})

            streaming = threading.Thread(target=stream)
            streaming.start()
            assert first.wait(30)
            updating = threading.Thread(target=update)
            updating.start()
            assert wait_until(lambda: engine.weight_version == 1)  # the update is sent; the core drains
            during = completion(server.url, PROMPTS[1])
            streaming.join(60)
            updating.join(60)
            assert "".join(c["choices"][0]["text"] for c in chunks) == old_text  # all on the old weights
            assert {c["system_fingerprint"].rsplit("-", 1)[1] for c in chunks} == {"w0"}
            assert results["update"].json() == {"weight_version": 1}
            assert during.json()["choices"][0]["text"] == new_text  # held, then run on the new weights
            assert during.json()["system_fingerprint"].endswith("-w1")
            text = httpx.get(server.url + "/metrics", headers=auth(KEY)).text
            assert metric(text, "stagedserve:weight_version") == 1
    finally:
        engine.shutdown()


def test_sleep_refuses_requests_with_a_503_and_wake_serves_the_same_text(tiny_llama):
    engine = AsyncLLM.from_llm(make_llm(tiny_llama, **SYNC), log_stats_interval=None)
    try:
        with running_server(create_app(engine, api_keys=[KEY], enable_dev_routes=True)) as server:
            before = completion(server.url, PROMPTS[1]).json()["choices"][0]["text"]
            slept = httpx.post(server.url + "/sleep?level=1", headers=auth(KEY), timeout=60)
            assert slept.status_code == 200 and slept.json()["freed_bytes"] > 0
            assert httpx.get(server.url + "/is_sleeping", headers=auth(KEY)).json() == {"is_sleeping": True}
            started = time.monotonic()
            refused = completion(server.url, PROMPTS[1])
            assert refused.status_code == 503 and "sleeping" in refused.json()["error"]["message"]
            assert time.monotonic() - started < 5  # refused, not left waiting
            text = httpx.get(server.url + "/metrics", headers=auth(KEY)).text
            assert metric(text, "stagedserve:sleep_level") == 1
            assert httpx.post(server.url + "/wake_up", headers=auth(KEY), timeout=60).json() == {"sleeping": False}
            assert completion(server.url, PROMPTS[1]).json()["choices"][0]["text"] == before
            assert httpx.post(server.url + "/reset_prefix_cache", headers=auth(KEY)).json() == {"reset": True}
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_the_engine_process_mode_takes_the_same_calls(tiny_llama, trained):
    import asyncio

    from stage5_server.engine.mp_client import MPAsyncLLM

    new_text = make_llm(trained[1]).generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].text
    engine = MPAsyncLLM(str(tiny_llama), log_stats_interval=None, startup_timeout_s=120, **ENGINE_KWARGS, **SYNC)
    try:
        assert [d["rank"] for d in asyncio.run(engine.collective_rpc("describe"))] == [0]
        with pytest.raises(ValueError, match="no method"):
            asyncio.run(engine.collective_rpc("nope"))
        with running_server(create_app(engine, api_keys=[KEY], enable_dev_routes=True)) as server:
            updated = httpx.post(server.url + "/update_weights", headers=auth(KEY), timeout=60,
                                 json={"path": str(trained[1])})
            assert updated.json() == {"weight_version": 1}
            response = completion(server.url, PROMPTS[1]).json()
            assert response["choices"][0]["text"] == new_text
            assert response["system_fingerprint"].endswith("-w1")
            httpx.post(server.url + "/sleep?level=1", headers=auth(KEY), timeout=60)
            assert completion(server.url, PROMPTS[1]).status_code == 503
            httpx.post(server.url + "/wake_up", headers=auth(KEY), timeout=60)
            assert completion(server.url, PROMPTS[1]).json()["choices"][0]["text"] == new_text
    finally:
        engine.shutdown()


# ---- the worked example ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_worked_example_moves_the_served_outputs_toward_the_target(capsys):
    import re
    import runpy

    example = runpy.run_path(str(REPO / "scripts" / "rl_weight_updates.py"))
    example["main"]([])
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ") and not line.startswith("round 0")]
    assert len(rounds) == 4 and out.count("  same tokens as transformers: True") == 4
    before, after = map(float, re.search(r"target share: ([\d.]+) -> ([\d.]+)", out).groups())
    assert before == 0 and after >= 0.8
    stale = re.search(r"without the reset: (\d+) prompt tokens from the cache, (\d+) of 16", out)
    assert int(stale.group(1)) > 0 and int(stale.group(2)) > 0  # stale KV reused: other tokens
    assert "with the reset: 0 differ" in out


@pytest.mark.slow
def test_ray_workers_take_the_same_calls(tiny_llama, trained, references):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", **SPLIT_KWARGS, **SYNC)
    try:
        assert [d["rank"] for d in llm.collective_rpc("describe")] == [0, 1]
        assert llm.collective_rpc(rank_and_offset, args=(1,)) == [1, 2]  # a function, pickled to each actor
        llm.update_weights_from_path(str(trained[1]))
        assert engine_tokens(llm) == references[1]
        llm.update_weights(hf_model(tiny_llama).state_dict().items())
        assert engine_tokens(llm) == references[0]
    finally:
        llm.shutdown()
        ray.shutdown()
