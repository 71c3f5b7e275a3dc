"""The scheduler's promises, tested with token ids only."""

from __future__ import annotations

import pytest

from stage3_continuous import CacheConfig, RequestStatus, Scheduler, SchedulerConfig, dry_run_step
from tests.stage3.scheduler_driver import make_request


def scheduler(budget=6, max_num_seqs=8, num_blocks=64, block_size=4, **kwargs):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, **kwargs),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks), max_model_len=256)


def test_seed_trace_budget_six_r0_decoding_r1_nine_token_prompt():
    sched = scheduler(budget=6)
    r0 = make_request("R0", 4)
    sched.add_request(r0)
    dry_run_step(sched)  # R0's prompt; from now on R0 is decoding
    r1 = make_request("R1", 9)
    sched.add_request(r1)
    trace = []
    for _ in range(3):
        r1_computed_before = r1.num_computed_tokens
        out = dry_run_step(sched)
        n = out.num_scheduled_tokens
        r1_tokens = n.get("R1", 0)
        r1_prefill = min(r1_tokens, max(0, 9 - r1_computed_before))
        trace.append((n["R0"], r1_prefill, r1_tokens - r1_prefill, out.total_num_scheduled_tokens))
    assert [t[0] for t in trace] == [1, 1, 1]  # R0 decodes every step, first
    assert [t[1] for t in trace] == [5, 4, 0]  # R1's prompt in two chunks
    assert [t[2] for t in trace] == [0, 0, 1]  # then R1 decodes
    assert [t[3] for t in trace] == [6, 5, 2]  # tokens used of the budget of 6
    assert r1.num_output_tokens == 2  # step 1 sampled R1's first token, step 2 its second


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = scheduler(budget=6, enable_chunked_prefill=False)
    sched.add_request(make_request("R0", 4))
    dry_run_step(sched)
    sched.add_request(make_request("R1", 9))
    out = dry_run_step(sched)
    assert out.num_scheduled_tokens == {"R0": 1}  # 9 > 5 left: R1 is not split
    roomy = scheduler(budget=16, enable_chunked_prefill=False)
    roomy.add_request(make_request("R1", 9))
    assert dry_run_step(roomy).num_scheduled_tokens == {"R1": 9}


def test_max_num_seqs_caps_requests_scheduled_per_step():
    sched = scheduler(budget=100, max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3))
    for _ in range(4):
        out = dry_run_step(sched)
        assert len(out.num_scheduled_tokens) <= 2
    assert len(sched.running) == 2


def test_max_num_active_seqs_caps_the_running_set_despite_spare_budget():
    sched = scheduler(budget=100, max_num_seqs=8, max_num_active_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=3))
    out = dry_run_step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"} and out.total_num_scheduled_tokens == 6
    for _ in range(3):
        dry_run_step(sched)
        assert len(sched.running) <= 2
    assert {r.request_id for r in sched.running} == {"r2", "r3"}  # joined as r0 and r1 left


def test_priority_policy_runs_lower_values_first_ties_by_arrival():
    sched = scheduler(budget=4, max_num_seqs=1, policy="priority")
    for rid, prio, arrival in [("low", 5, 0.0), ("high", 0, 1.0), ("mid", 3, 2.0), ("high2", 0, 3.0)]:
        sched.add_request(make_request(rid, 2, max_tokens=1, priority=prio, arrival=arrival))
    order = [next(iter(dry_run_step(sched).num_scheduled_tokens)) for _ in range(4)]
    assert order == ["high", "high2", "mid", "low"]


def test_update_from_output_finishes_on_eos_stop_token_and_max_tokens():
    sched = scheduler(budget=100)
    sched.add_request(make_request("eos", 3, eos=(7,)))
    sched.add_request(make_request("stop", 3, stop_token_ids=(7,)))
    sched.add_request(make_request("len", 3, max_tokens=2))
    reqs = dict(sched.requests)
    dry_run_step(sched, token=7)
    assert reqs["eos"].status == RequestStatus.FINISHED_STOPPED and reqs["eos"].stop_reason is None
    assert reqs["stop"].status == RequestStatus.FINISHED_STOPPED and reqs["stop"].stop_reason == 7
    assert reqs["len"].status == RequestStatus.RUNNING
    dry_run_step(sched, token=8)
    assert reqs["len"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.kv_cache_manager.usage == 0 and not sched.has_unfinished_requests()


def test_a_request_mid_prefill_gets_no_token_and_keeps_its_place():
    sched = scheduler(budget=4)
    r = make_request("r", 10)
    sched.add_request(r)
    dry_run_step(sched)
    assert r.num_computed_tokens == 4 and r.num_output_tokens == 0 and r.status == RequestStatus.RUNNING


def test_abort_of_waiting_and_running_requests_frees_blocks_and_reports_them():
    sched = scheduler(budget=8, max_num_seqs=1)
    sched.add_request(make_request("running", 6))
    sched.add_request(make_request("waiting", 6))
    dry_run_step(sched)
    assert sched.kv_cache_manager.usage > 0
    sched.finish_requests(["running", "waiting"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.usage == 0 and not sched.has_unfinished_requests()
    assert dry_run_step(sched).finished_req_ids == {"running", "waiting"}


def test_preemption_by_recompute_frees_the_newest_and_requeues_it_first_with_its_tokens():
    # 4 blocks of 4 tokens; two requests of 6 prompt tokens take 2 blocks each, then must grow.
    sched = scheduler(budget=100, num_blocks=4, block_size=4)
    old, new = make_request("old", 6, arrival=0.0), make_request("new", 6, arrival=1.0)
    sched.add_request(old)
    sched.add_request(new)
    sched.add_request(make_request("later", 2, arrival=2.0))
    for _ in range(3):  # prefill 6, then decode positions 6 and 7: still 2 blocks each
        assert not dry_run_step(sched).preempted_req_ids
    out = dry_run_step(sched)  # position 8 needs a third block each; only 'new' can be sacrificed
    assert out.preempted_req_ids == {"new"}
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_output_tokens == 3  # generated tokens are kept
    assert sched.waiting[0] is new  # ahead of 'later'
    assert sched.stats().num_preemptions == 1
    sched.finish_requests(["old"], RequestStatus.FINISHED_ABORTED)
    out = dry_run_step(sched)
    assert out.num_scheduled_tokens["new"] == 9  # re-prefills prompt (6) + output (3)
    assert new in out.scheduled_new_reqs


def test_bad_scheduler_config_names_the_field():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_active_seqs"):
        SchedulerConfig(max_num_seqs=4, max_num_active_seqs=8)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


def test_prompt_that_can_never_fit_the_pool_is_rejected_on_arrival():
    sched = scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_request("huge", 20))
    assert not sched.has_unfinished_requests()


def test_stage3_does_not_take_enable_prefix_caching(tiny_llama):
    from stage3_continuous import LLM

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model=str(tiny_llama), enable_prefix_caching=True)
