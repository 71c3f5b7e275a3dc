"""Pipeline parallelism on CPU: the layers split into stages (gloo ranks passing hidden states),
the same tokens as one process and as transformers, two batches in flight, each stage holding only
its own layers and their KV; combined with tensor parallelism; refusals named up front.

The split engines start once per module (spawning workers costs seconds on 2 cores).
"""

from __future__ import annotations

import ipaddress

import httpx
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from course.tiny_model import TINY, make_tiny_model
from shared import SamplingParams
from shared.request import RequestStatus
from stage5_server import LLM
from stage5_server.cli.serve import serving_process_count
from stage5_server.core.messages import EngineCoreRequest
from stage5_server.parallel.pipeline import stage_layers
from stage5_server.server import create_app
from tests.invariants.prompts import hf_greedy
from tests.stage5.server_fixtures import (
    auth,
    counts_of,
    running_server,
    serving_or_exited,
    serving_processes,
    spawn_serve,
    stop_serve,
    wait_until,
)

ENGINE_KWARGS = dict(max_model_len=256, max_num_seqs=8, block_size=4, max_num_batched_tokens=16, device="cpu",
                     attention_backend="torch", kv_cache_memory=1 << 20)
# Chunked prefill (a 30-token prompt over a 16-token budget), several requests, decode to 16 tokens.
PROMPTS = ["Hello there, how are", "The quick brown fox jumps over", list(range(3, 33)), "A", "def add(a, b):",
           "One more prompt, so that the batches split"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
KEY = "pp-key"


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """Three layers over two stages: 2 + 1, an uneven split."""
    return make_tiny_model(tmp_path_factory.mktemp("pp") / "llama3l", "llama", size={**TINY, "num_hidden_layers": 3})


@pytest.fixture(scope="module")
def pair(three_layers):
    single = LLM(model=str(three_layers), **ENGINE_KWARGS)
    split = LLM(model=str(three_layers), pipeline_parallel_size=2, **ENGINE_KWARGS)
    yield single, split
    split.shutdown()


@given(num_layers=st.integers(1, 64), stages=st.integers(1, 8))
def test_stages_cover_every_layer_once_in_order_and_differ_by_at_most_one(num_layers, stages):
    if stages > num_layers:
        return
    runs = [stage_layers(num_layers, stages, s) for s in range(stages)]
    assert [i for run in runs for i in run] == list(range(num_layers))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    assert all(len(run) >= 1 for run in runs)


def test_bad_splits_are_refused_before_any_process_starts(tiny_llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size: 3 stages need at least 3 layers; the model has 2"):
        LLM(model=str(tiny_llama), pipeline_parallel_size=3, device="cpu")
    for bad in (0, "2", 1.5):
        with pytest.raises(ValueError, match="pipeline_parallel_size: must be an integer >= 1"):
            LLM(model=str(tiny_llama), pipeline_parallel_size=bad, device="cpu")
    with pytest.raises(ValueError, match="speculative decoding runs without pipeline parallelism"):
        LLM(model=str(tiny_llama), pipeline_parallel_size=2, device="cpu",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_greedy_tokens_are_identical_to_one_process_and_to_transformers(pair, three_layers):
    single, split = pair
    got = token_ids(split.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got == token_ids(single.generate(PROMPTS, GREEDY, use_tqdm=False))
    prompt_ids = tuple(tuple(split.tokenizer.encode(p) if isinstance(p, str) else p) for p in PROMPTS)
    assert got == hf_greedy(three_layers, prompt_ids, GREEDY.max_tokens)


def test_two_batches_are_in_flight_and_no_request_is_in_both(pair, monkeypatch):
    _, split = pair
    core, scheduler = split.engine, split.engine.scheduler
    overlaps, scheduled_beside_a_batch = [], []
    schedule = scheduler.schedule

    def schedule_and_check():
        output = schedule()
        overlaps.append(set(output.num_scheduled_tokens) & scheduler.in_flight)
        scheduled_beside_a_batch.append(bool(scheduler.in_flight and output.num_scheduled_tokens))
        return output

    monkeypatch.setattr(scheduler, "schedule", schedule_and_check)
    core.most_batches_in_flight = 0
    fresh = [f"In flight: {p}" for p in PROMPTS if isinstance(p, str)]  # no cached prefix: several prefill chunks
    split.generate(fresh, GREEDY, use_tqdm=False)
    assert core.most_batches_in_flight == 2  # each stage worked on a different batch
    assert sum(scheduled_beside_a_batch) >= 4
    assert not any(overlaps), "a request was scheduled while its last batch was still in flight"


def test_seeded_sampling_and_prompt_logprobs_are_identical_to_one_process(pair):
    single, split = pair
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=s, prompt_logprobs=2, logprobs=1)
              for s in range(len(PROMPTS))]
    expected = single.generate(PROMPTS, params, use_tqdm=False)
    got = split.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(got) == token_ids(expected)
    for g, want in zip(got, expected):
        for position, entry in enumerate(g.prompt_logprobs[1:], start=1):
            for token, logprob in entry.items():
                assert logprob.logprob == pytest.approx(want.prompt_logprobs[position][token].logprob, abs=1e-4)


def test_each_stage_holds_its_own_layers_and_the_kv_budget_counts_the_larger_stage(pair):
    single, split = pair
    workers = split.engine.model_executor.workers
    assert [(w["rank"], w["stage"], w["num_layers"]) for w in workers] == [(0, 0, 2), (1, 1, 1)]
    blocks = lambda llm: llm.engine.scheduler.kv_cache_manager.block_pool.num_blocks  # noqa: E731
    # The same kv_cache_memory per rank; the larger stage holds 2 of the 3 layers: 3/2 the blocks.
    assert blocks(split) == pytest.approx(1.5 * blocks(single), rel=0.02)


def test_an_abort_while_its_batch_is_in_flight_loses_nothing_else(pair):
    """A request aborted with its batch in flight frees its blocks at once; the batch after it may
    reuse them, and every other request still gets one process's tokens."""
    single, split = pair
    core = split.engine
    expected = token_ids(single.generate(PROMPTS, GREEDY, use_tqdm=False))
    for i, prompt in enumerate(PROMPTS):
        ids = split.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        core.add_request(core.preprocess_add_request(EngineCoreRequest(
            request_id=f"abort-test-{i}", prompt_token_ids=ids, sampling_params=GREEDY, arrival_time=0.0)))
    core.step()  # one batch in flight
    assert core.batch_queue
    victim = next(iter(core.batch_queue[0][0].num_scheduled_tokens))
    core.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
    tokens, finished = {}, {}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished[output.request_id] = tokens[output.request_id]
    for i, want in enumerate(expected):
        if f"abort-test-{i}" != victim:
            assert finished[f"abort-test-{i}"] == want


def test_server_on_two_stages_answers_with_the_same_tokens(pair):
    single, split = pair
    prompt = PROMPTS[1]
    reference = single.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    app = create_app(split, api_keys=[KEY], served_model_name="pp", log_stats_interval=None)
    with running_server(app) as server, httpx.Client(base_url=server.url, headers=auth(KEY), timeout=60) as http:
        body = {"model": "pp", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == reference.text


@pytest.mark.slow
def test_tied_embeddings_and_two_by_two_ranks_match_one_process(tiny_qwen3):
    """Qwen3 ties its LM head to the embedding: the last stage keeps the embedding to hold it. Four ranks,
    TP 2 inside each of 2 stages, on the same tokens as one process."""
    single = LLM(model=str(tiny_qwen3), **ENGINE_KWARGS)
    expected = token_ids(single.generate(PROMPTS, GREEDY, use_tqdm=False))
    for tp, pp in ((1, 2), (2, 2)):
        split = LLM(model=str(tiny_qwen3), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE_KWARGS)
        try:
            assert token_ids(split.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected, (tp, pp)
            workers = split.engine.model_executor.workers
            assert [(w["rank"], w["stage"]) for w in workers] == [(r, r // tp) for r in range(tp * pp)]
        finally:
            split.shutdown()


@pytest.mark.slow
def test_every_process_of_a_split_data_parallel_server_listens_on_loopback_only(tiny_llama, tmp_path):
    """The seeds' network rule on the default configuration: no socket of any serving process (API
    server, engine cores, coordinator, the pipeline's workers) is open on a non-loopback address."""
    log = (tmp_path / "serve.log").open("w+")
    process, url = spawn_serve(tiny_llama, log, "--data-parallel-size", "2", "--api-server-count", "1",
                               "--pipeline-parallel-size", "2", "--max-model-len", "128", "--num-kv-blocks", "32",
                               "--uvicorn-log-level", "warning")
    try:
        assert wait_until(serving_or_exited(process, url), timeout=240, interval=0.5) and process.poll() is None, \
            log.read()
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        roles = serving_processes(psutil.Process(process.pid))
        assert counts_of(roles) == serving_process_count(1, 2, 1, 2)  # 1 + 2 + 4 workers + the coordinator
        listening = []
        for proc in (p for group in roles.values() for p in group):
            for conn in proc.net_connections(kind="inet"):
                if conn.laddr:
                    assert ipaddress.ip_address(conn.laddr.ip).is_loopback, (proc.name(), conn)
                    listening += [conn] if conn.status == psutil.CONN_LISTEN else []
        assert listening, "the HTTP server listens (on 127.0.0.1)"
    finally:
        stop_serve(process)
