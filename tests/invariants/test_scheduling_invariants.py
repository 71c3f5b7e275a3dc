"""Promises of every continuously batching stage (3 and later)."""

from __future__ import annotations

from shared import SamplingParams
from tests.invariants.prompts import PROMPTS

MIN_STAGE = 3


def test_token_budget_and_sequence_caps_hold_every_step(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama, max_num_batched_tokens=12, max_num_seqs=3, max_num_active_seqs=2)
    llm.engine.step_trace = []
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 14, 6)]
    outs = llm.generate(list(PROMPTS) * 2, params * 2, use_tqdm=False)
    assert all(o.finished for o in outs) and len(outs) == 10
    trace = llm.engine.step_trace
    assert all(sum(step.values()) <= 12 and len(step) <= 2 for step in trace)
    assert any(sum(step.values()) == 12 for step in trace)  # the budget was actually the limit


def test_preemption_is_transparent_to_greedy_outputs(stage, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)  # recomputed prefill
    roomy = stage.make_llm(tiny_llama).generate(list(PROMPTS), [params, scored] * 2 + [params], use_tqdm=False)
    tight = stage.make_llm(tiny_llama, num_kv_blocks=24, max_num_batched_tokens=32, max_model_len=96)
    squeezed = tight.generate(list(PROMPTS), [params, scored] * 2 + [params], use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]
    for a, b in zip(squeezed, roomy):  # a preempted request's prompt is not scored twice
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        if a.prompt_logprobs is not None:
            assert len(a.prompt_logprobs) == len(a.prompt_token_ids)
            assert [list(e) if e else e for e in a.prompt_logprobs] == [list(e) if e else e for e in b.prompt_logprobs]
    assert tight.engine.kv_cache_usage() == 0


def test_requests_join_while_others_are_decoding(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = llm.add_request(PROMPTS[0], params)
    for _ in range(3):
        llm.step()
    second = llm.add_request(PROMPTS[1], params)
    llm.engine.step_trace = []
    llm.step()
    assert set(llm.engine.step_trace[-1]) == {first, second}  # joined without waiting for a batch to end
