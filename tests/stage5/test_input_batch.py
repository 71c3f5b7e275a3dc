"""stage5's persistent input batch gives the forward pass exactly the tensors stage 3's list-built
preparation gives, step after step, while requests join, grow, are preempted, abort and leave."""

from __future__ import annotations

import gc
import random
import weakref

import torch

from shared import SamplingParams
from shared.model_runner import prepare_inputs
from stage2_paged.attention import build_paged_metadata
from stage3_continuous.engine import kv_layout
from stage4_prefix_cache import LLM as PrefixCachingLLM
from stage5_server import LLM
from stage5_server.executor.uniproc import UniProcExecutor
from stage5_server.worker import InputBatch, input_batch

ENGINE = dict(device="cpu", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=24, block_size=4)


def rows_of(llm: LLM) -> InputBatch:
    return llm.engine.model_executor.driver_worker.model_runner.input_batch


def checked_against_lists(llm: LLM) -> list[int]:
    """Make every step of ``llm`` compare its gathered inputs with the list-built ones; returns the
    number of tokens of each step compared."""
    batch_of_rows, scheduler = rows_of(llm), llm.engine.scheduler
    prepare = batch_of_rows.prepare
    checked: list[int] = []

    def compared(step):
        # The engine's own requests, as the scheduler left them for this step (stage 3's packing order).
        expected_batch = [(scheduler.requests[rid], n) for rid, n in step.num_scheduled_tokens.items()]
        tables = {rid: scheduler.kv_cache_manager.get_block_ids(rid) for rid in step.num_scheduled_tokens}
        prepared = prepare(step)
        inputs, meta = prepared.inputs, prepared.attn_metadata
        batch = list(zip(prepared.states, prepared.num_scheduled))
        expected = prepare_inputs(expected_batch, "cpu")
        slots, tables = kv_layout(expected_batch, tables, batch_of_rows.block_size)
        expected_meta = build_paged_metadata(slots, expected.query_start_loc, expected.seq_lens, tables, "cpu")
        assert [(r.request_id, n) for r, n in batch] == [(r.request_id, n) for r, n in expected_batch]
        for name in ("input_ids", "positions"):
            assert torch.equal(getattr(inputs, name), getattr(expected, name)), name
        assert (inputs.query_start_loc, inputs.seq_lens, inputs.sample_rows) == (
            expected.query_start_loc, expected.seq_lens, expected.sample_rows)
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            got, want = getattr(meta, name), getattr(expected_meta, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert (meta.max_query_len, meta.max_seq_len) == (expected_meta.max_query_len, expected_meta.max_seq_len)
        checked.append(int(inputs.input_ids.numel()))
        return prepared

    batch_of_rows.prepare = compared
    return checked


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def test_stage5_runs_one_worker_in_process_with_a_persistent_batch(tiny_llama):
    executor = LLM(str(tiny_llama), **ENGINE).engine.model_executor
    assert isinstance(executor, UniProcExecutor)
    assert isinstance(executor.driver_worker.model_runner.input_batch, InputBatch)


def test_inputs_match_the_list_built_ones_through_chunked_prefill_and_preemption(tiny_llama):
    prompts = random_prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(str(tiny_llama), num_kv_blocks=24, **ENGINE)  # few blocks: requests are preempted
    checked = checked_against_lists(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0 and max(checked) > 4  # preempted, and prefill chunks ran
    reference = PrefixCachingLLM(str(tiny_llama), num_kv_blocks=24, **ENGINE).generate(prompts, params,
                                                                                       use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert rows_of(llm).num_rows == ENGINE["max_num_seqs"]  # finished requests gave their rows back


def test_an_aborted_request_id_taken_again_gets_a_fresh_row(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE)
    checked_against_lists(llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first, second = random_prompts(2, seed=1)
    llm.add_request(first, params, request_id="a")
    llm.step()
    llm.step()
    llm.abort("a")
    llm.add_request(second, params, request_id="a")
    finished = {}
    while llm.has_unfinished_requests():
        finished.update((o.request_id, o) for o in llm.step() if o.finished)
    alone = LLM(str(tiny_llama), **ENGINE).generate([second], params, use_tqdm=False)[0]
    assert finished["a"].outputs[0].token_ids == alone.outputs[0].token_ids


def test_rows_widen_for_a_request_longer_than_they_were_made(tiny_llama, monkeypatch):
    initial_width = 8
    monkeypatch.setattr(input_batch, "INITIAL_TOKENS_PER_ROW", initial_width)
    llm = LLM(str(tiny_llama), **ENGINE)
    checked_against_lists(llm)
    prompts = random_prompts(5, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert rows_of(llm).token_ids.shape[1] >= max(map(len, prompts)) + 30 > initial_width


def test_rows_of_requests_aborted_while_nothing_ran_are_taken_back(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE)
    checked_against_lists(llm)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(2 * ENGINE["max_num_seqs"], seed=3)
    first = [llm.add_request(p, params) for p in prompts[:ENGINE["max_num_seqs"]]]
    llm.step()
    llm.abort(first)
    assert llm.step() == []  # nothing to run: the engine never sees these requests leave
    outputs = llm.generate(prompts[ENGINE["max_num_seqs"]:], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert rows_of(llm).num_rows == ENGINE["max_num_seqs"]


def test_a_finished_or_aborted_request_is_kept_alive_by_nothing_in_the_worker(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE)
    rows = rows_of(llm)
    engine_requests = []
    add_request = llm.engine.add_request
    llm.engine.add_request = lambda request: (engine_requests.append(weakref.ref(request)), add_request(request))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first, second, third = random_prompts(3, seed=4)
    llm.generate([first, second], params, use_tqdm=False)
    gc.collect()
    assert len(engine_requests) == 2 and not any(ref() for ref in engine_requests)  # no step came after the last
    request_id = llm.add_request(third, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    llm.step()
    llm.step()
    assert list(rows.row_of) == [request_id] and set(rows.states) == {request_id}  # the workers learnt of the others
    llm.abort(request_id)
    gc.collect()
    assert not engine_requests[-1]()
    llm.generate([first], params, use_tqdm=False)  # the next step tells the workers to forget the aborted one
    assert request_id not in rows.states and request_id not in rows.row_of
