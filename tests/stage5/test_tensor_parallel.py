"""Tensor parallelism on CPU: 2 gloo ranks give the same tokens as one process, offline and
through the server; bad splits are refused up front; traffic stays on loopback; a rank that
dies stops the engine with an error instead of a hang.

The 2-rank engines start once per module (spawning workers costs seconds on 2 cores).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
import torch

from course.tiny_model import TINY, make_tiny_model
from shared import SamplingParams
from shared.config import ModelConfig
from stage5_server import LLM
from stage5_server.executor.multiproc import MultiprocExecutor, TensorParallelError
from stage5_server.parallel import tensor_parallel_shape
from stage5_server.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from stage5_server.parallel.parallel_state import check_tensor_parallel_size, resolve_interface
from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, running_server, wait_until

ENGINE_KWARGS = dict(max_model_len=256, max_num_seqs=8, block_size=4, max_num_batched_tokens=16, device="cpu",
                     attention_backend="torch", kv_cache_memory=1 << 20)
# Chunked prefill (a 30-token prompt over a 16-token budget), batches of several, decode to 20 tokens.
PROMPTS = ["Hello there, how are", "The quick brown fox jumps over", list(range(3, 33)), "A"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
KEY = "tp-key"


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run_with_timeout(fn, timeout: float):
    """``fn()``'s result or exception; fails the test if it has not returned within ``timeout`` seconds."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still blocked after {timeout}s: a hang, not an error"
    return box


@pytest.fixture(scope="module")
def pair(tiny_llama):
    single = LLM(model=str(tiny_llama), **ENGINE_KWARGS)
    split = LLM(model=str(tiny_llama), tensor_parallel_size=2, **ENGINE_KWARGS)
    yield single, split
    split.shutdown()


# ---- refusals: checked before any process starts ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_config(tiny_llama) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_llama)


def test_heads_that_do_not_divide_are_refused_naming_the_fields(tiny_llama, tiny_config):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(model=str(tiny_llama), tensor_parallel_size=3, device="cpu")
    six_heads = dataclasses.replace(tiny_config, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by tensor_parallel_size=2"):
        tensor_parallel_shape(six_heads, 2)
    eight_heads = dataclasses.replace(tiny_config, num_attention_heads=8, num_key_value_heads=3)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 is not a multiple of num_key_value_heads=3"):
        tensor_parallel_shape(eight_heads, 4)
    with pytest.raises(ValueError, match="intermediate_size=255"):
        tensor_parallel_shape(dataclasses.replace(tiny_config, intermediate_size=255), 2)


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_config):
    shape = tensor_parallel_shape(tiny_config, 4)  # 4 query heads, 2 KV heads over 4 ranks
    assert (shape.num_heads, shape.num_kv_heads, shape.kv_head_replicas) == (1, 1, 2)
    # Query head r belongs to KV head r // 2 (groups of 2); rank r holds exactly that one.
    assert [shape.kv_head_start(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert tensor_parallel_shape(tiny_config, 2).num_kv_heads == 1


def test_more_ranks_than_gpus_are_refused_and_more_than_cores_are_logged(tiny_llama, tiny_config, monkeypatch,
                                                                          caplog):
    with monkeypatch.context() as patch, caplog.at_level("WARNING", logger="stagedserve"):
        patch.setattr(os, "cpu_count", lambda: 1)  # a one-core machine: the ranks take turns on it
        assert check_tensor_parallel_size(2, tiny_config, torch.device("cpu"), pipeline_parallel_size=2) == 2
    assert "4 ranks share 1 CPU cores" in caplog.text
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks need 2 GPUs, found"):
            LLM(model=str(tiny_llama), tensor_parallel_size=2, device="cuda")
    for bad in (0, "2", 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size: must be an integer >= 1"):
            LLM(model=str(tiny_llama), tensor_parallel_size=bad, device="cpu")


def test_unknown_interface_is_refused_and_the_default_is_loopback(monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    assert resolve_interface(None).startswith("lo")
    with pytest.raises(ValueError, match="distributed_interface: no network interface 'nope0'"):
        resolve_interface("nope0")


def test_vllm_host_ip_names_the_interface_that_holds_it_unless_one_is_named(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    assert resolve_interface(None).startswith("lo")
    monkeypatch.setenv("VLLM_HOST_IP", "198.51.100.254")  # TEST-NET-2: documentation only, on no host
    with pytest.raises(ValueError, match="VLLM_HOST_IP: no network interface of this host has the address"):
        resolve_interface(None)
    assert resolve_interface(resolve_interface("lo")) == "lo"  # a named interface wins


def test_vocab_shards_pad_past_the_vocabulary_and_the_head_drops_the_padding():
    full = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)  # a 5-token vocabulary over 2 ranks: 3 + 3 rows
    last = VocabParallelEmbedding(3, 2, start=3, vocab_size=5)
    assert torch.equal(last.load_shard("weight", full), torch.tensor([[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]))
    head = ParallelLMHead(6, 2, start=0, vocab_size=5)  # one rank holding the padded vocabulary
    assert head(torch.ones(1, 2)).shape == (1, 5)


# ---- two ranks against one -----------------------------------------------------------------------------------


def test_greedy_tokens_are_identical_to_one_process(pair):
    single, split = pair
    assert token_ids(split.generate(PROMPTS, GREEDY, use_tqdm=False)) == \
        token_ids(single.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_seeded_sampling_is_identical_to_one_process(pair):
    single, split = pair
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=s) for s in range(len(PROMPTS))]
    assert token_ids(split.generate(PROMPTS, params, use_tqdm=False)) == \
        token_ids(single.generate(PROMPTS, params, use_tqdm=False))


def test_each_rank_holds_half_the_heads_and_the_kv_budget_is_per_rank(pair):
    single, split = pair
    ranks = split.engine.model_executor.workers
    assert [(w["rank"], w["num_heads"], w["num_kv_heads"]) for w in ranks] == [(0, 2, 1), (1, 2, 1)]
    # Same kv_cache_memory per device, half the KV heads per rank: twice the blocks.
    blocks = lambda llm: llm.engine.scheduler.kv_cache_manager.block_pool.num_blocks  # noqa: E731
    assert blocks(split) == 2 * blocks(single)
    assert isinstance(split.engine.model_executor, MultiprocExecutor)  # the engine process holds no weights


def worker_parts(worker) -> tuple:
    """Run on a worker (``collective_rpc`` with a function): its classes and whether it samples."""
    runner = worker.model_runner
    return type(worker), type(runner), type(runner.input_batch), runner.is_driver


def test_every_rank_runs_the_single_device_worker_runner_and_batch_and_only_rank_0_samples(pair):
    single, split = pair
    one_device = single.engine.model_executor.collective_rpc(worker_parts)
    assert split.engine.model_executor.collective_rpc(worker_parts) == [one_device[0][:3] + (True,),
                                                                        one_device[0][:3] + (False,)]


def test_prompt_logprobs_are_the_same_as_one_process(pair):
    single, split = pair
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1)
    expected = single.generate(PROMPTS[:2], params, use_tqdm=False)
    for got, want in zip(split.generate(PROMPTS[:2], params, use_tqdm=False), expected):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        top = lambda output: [sorted(e) if e else e for e in output.prompt_logprobs]  # noqa: E731
        assert top(got) == top(want)
        for position, entry in enumerate(got.prompt_logprobs[1:], start=1):
            for token, logprob in entry.items():
                assert logprob.logprob == pytest.approx(want.prompt_logprobs[position][token].logprob, abs=1e-4)


def test_rank_traffic_stays_on_loopback(pair):
    """Every socket of every rank, listening or connected, is on a loopback address (a TCP rendezvous
    store would listen on all interfaces: the ranks meet through a file instead)."""
    _, split = pair
    for pid in split.engine.model_executor.pids:
        sockets = [c for c in psutil.Process(pid).net_connections(kind="inet") if c.laddr]
        assert sockets, "the ranks talk over sockets"
        for conn in sockets:
            assert ipaddress.ip_address(conn.laddr.ip).is_loopback, conn


def test_server_on_two_ranks_answers_with_the_same_tokens(pair):
    single, split = pair
    prompt = PROMPTS[1]
    reference = single.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    app = create_app(split, api_keys=[KEY], served_model_name="tp", log_stats_interval=None)
    with running_server(app) as server, httpx.Client(base_url=server.url, headers=auth(KEY), timeout=60) as http:
        body = {"model": "tp", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == reference.text
        assert response.json()["usage"]["completion_tokens"] == len(reference.token_ids)


def test_shutdown_stops_every_worker(pair):
    _, split = pair
    processes = split.engine.model_executor.processes
    split.shutdown()
    assert all(not p.is_alive() for p in processes)
    with pytest.raises(TensorParallelError, match="down"):
        split.generate(["after shutdown"], GREEDY, use_tqdm=False)


# ---- other shapes (each starts its own ranks) -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v bias; per-head q/k norms and tied embeddings
def test_other_families_match_one_process(arch, checkpoints):
    path = str(checkpoints[arch])
    expected = token_ids(LLM(model=path, **ENGINE_KWARGS).generate(PROMPTS, GREEDY, use_tqdm=False))
    split = LLM(model=path, tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        assert token_ids(split.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    finally:
        split.shutdown()


@pytest.mark.slow
def test_one_kv_head_replicated_on_both_ranks_and_an_odd_vocabulary(tmp_path):
    path = make_tiny_model(tmp_path / "mqa", vocab_size=509, size=dict(TINY, num_key_value_heads=1))
    config = ModelConfig.from_pretrained(path)
    assert config.num_key_value_heads == 1 and config.vocab_size % 2 == 1  # the shapes this test is about
    expected = token_ids(LLM(model=str(path), **ENGINE_KWARGS).generate(PROMPTS, GREEDY, use_tqdm=False))
    split = LLM(model=str(path), tensor_parallel_size=2, **ENGINE_KWARGS)
    try:
        assert [w["num_kv_heads"] for w in split.engine.model_executor.workers] == [1, 1]
        assert token_ids(split.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    finally:
        split.shutdown()


@pytest.mark.slow
def test_a_rank_killed_mid_generation_fails_the_request_and_health_instead_of_hanging(tiny_llama):
    split = LLM(model=str(tiny_llama), tensor_parallel_size=2, **ENGINE_KWARGS)
    app = create_app(split, api_keys=[KEY], served_model_name="tp", log_stats_interval=None)
    engine = app.state.engine
    try:
        with running_server(app) as server, httpx.Client(base_url=server.url, headers=auth(KEY), timeout=60) as http:
            assert http.get("/health").status_code == 200
            body = {"model": "tp", "prompt": "a long answer", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            box: dict = {}
            request = threading.Thread(target=lambda: box.update(response=http.post("/v1/completions", json=body)))
            request.start()
            assert wait_until(lambda: engine.stats.num_generation_tokens >= 3, timeout=30), "generation never began"
            os.kill(split.engine.model_executor.pids[1], signal.SIGKILL)
            killed = time.monotonic()
            request.join(60)
            assert not request.is_alive(), "the request hangs after a rank died"
            assert time.monotonic() - killed < 30
            assert box["response"].status_code == 503, box["response"].text
            assert box["response"].json()["error"]["code"] == "engine_unavailable"
            assert wait_until(lambda: http.get("/health").status_code == 503, timeout=10)
        executor = split.engine.model_executor
        assert all(p.exitcode is not None for p in executor.processes), "no rank outlives the failure"
        assert "rank 1" in str(executor.failure) and "exited with code -9" in str(executor.failure)
        # The engine stays down, and says so at once.
        box = run_with_timeout(lambda: split.generate(["again"], GREEDY, use_tqdm=False), timeout=10)
        assert isinstance(box.get("error"), TensorParallelError)
    finally:
        split.shutdown()
