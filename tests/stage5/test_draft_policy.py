"""The draft-length policy: a request drafts only as many tokens as its recent acceptance says
pay at this batch size, probes now and then once it stops, and the engine's outputs never depend
on it (every draft is verified)."""

from __future__ import annotations

import pytest

from shared import SamplingParams
from stage5_server import LLM
from stage5_server.spec_decode import DraftPolicy
from stage5_server.spec_decode.policy import PROBE_EVERY

COSTLY = 0.15  # a machine where a position costs 15% of a step's fixed cost (spec_decode/policy.py)


def test_a_new_request_drafts_k_at_batch_one_and_fewer_at_a_large_batch():
    policy = DraftPolicy(4, COSTLY)
    assert policy.num_drafts("a", batch_size=1) == 4
    assert policy.num_drafts("b", batch_size=16) == 1  # alpha 0.8, 0.64 against theta 0.71: only the first pays
    assert policy.num_drafts("c", batch_size=64) == 0  # theta 0.91


@pytest.mark.parametrize("batch_size, expected", [(1, 4), (16, 4)])
def test_a_request_whose_drafts_are_all_accepted_keeps_drafting_k(batch_size, expected):
    policy = DraftPolicy(4, COSTLY)
    for _ in range(10):
        policy.observe("copy", 4, 4)
    assert policy.num_drafts("copy", batch_size) == expected


def test_a_request_whose_drafts_are_rejected_drafts_fewer_then_none_then_probes():
    policy = DraftPolicy(4, COSTLY)
    lengths = []
    for _ in range(4):
        lengths.append(policy.num_drafts("chat", batch_size=4))
        policy.observe("chat", max(lengths[-1], 1), 0)
    assert lengths[0] == 4 and lengths[-1] == 0 and lengths == sorted(lengths, reverse=True)
    probes = [policy.num_drafts("chat", batch_size=4) for _ in range(PROBE_EVERY)]
    assert probes == [0] * (PROBE_EVERY - 1) + [1]  # one draft, to notice a text that turned into a copy
    policy.observe("chat", 1, 1)
    assert policy.num_drafts("chat", batch_size=16) == 0  # one accepted probe is not enough evidence at batch 16
    assert policy.num_drafts("chat", batch_size=1) >= 1  # but at batch 1 a draft costs little


def test_a_draft_after_a_rejection_was_never_examined():
    policy = DraftPolicy(4, COSTLY)
    policy.observe("r", 4, 1)  # the first kept, the second rejected, two never checked
    state = policy.requests["r"]
    assert state.examined == pytest.approx(0.8 * 2.0 + 2) and state.accepted == pytest.approx(0.8 * 1.6 + 1)


def test_on_a_gpu_every_request_drafts_k_at_a_small_batch():
    policy = DraftPolicy.for_device(4, "cuda")
    policy.observe("chat", 4, 0)
    policy.observe("chat", 4, 1)
    assert policy.num_drafts("chat", batch_size=16) >= 3
    cpu = DraftPolicy.for_device(4, "cpu")
    assert policy.threshold(16) < cpu.threshold(16) < cpu.threshold(64)


def test_the_engine_drafts_less_with_the_policy_and_gives_the_same_tokens(tiny_llama):
    """A tiny random model rarely continues its n-gram matches: with the policy on, its requests
    stop drafting most tokens; the outputs are those without speculation either way."""
    engine = dict(device="cpu", dtype="float32", max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64,
                  block_size=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [5, 17, 42, 99, 7, 3] * 4, [9, 8, 7, 6] * 5]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **engine).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    drafted = {}
    for name in ("fixed", "adaptive"):
        llm = LLM(str(tiny_llama), **engine, speculative_config=spec)
        assert llm.engine.draft_policy is not None
        if name == "fixed":
            llm.engine.draft_policy = None
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
        stats = llm.engine.stats()
        drafted[name] = (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
        if name == "adaptive":
            assert not llm.engine.draft_policy.requests  # finished requests are forgotten
    assert drafted["adaptive"][0] < drafted["fixed"][0]
    rate = {name: accepted / max(tokens, 1) for name, (tokens, accepted) in drafted.items()}
    assert rate["adaptive"] >= rate["fixed"]
