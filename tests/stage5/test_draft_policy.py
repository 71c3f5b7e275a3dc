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
    probes = [policy.num_drafts("chat", batch_size=4) for _ in range(19)]
    # One draft, to notice a text that turned into a copy: a draft costs theta = 0.6 / 1.6 here, so one
    # probe in ceil(0.375 / PROBE_BUDGET) = 19 steps.
    assert probes == [0] * 18 + [1]
    policy.observe("chat", 1, 1)
    assert policy.num_drafts("chat", batch_size=16) == 0  # one accepted probe is not enough evidence at batch 16
    assert policy.num_drafts("chat", batch_size=1) >= 1  # but at batch 1 a draft costs little


def test_probes_come_every_eighth_step_where_a_draft_is_cheap_and_rarer_where_it_is_not():
    """Prompt lookup on the CPU at batch 1 probes every PROBE_EVERY steps; a draft model costing 0.37 of
    the target every ceil(0.385 / PROBE_BUDGET) = 20 steps, keeping probes near 2% of the time."""
    for rho, every in ((0.0, PROBE_EVERY), (0.37, 20)):
        policy = DraftPolicy(4, 0.015, draft_cost_ratio=rho)
        for _ in range(30):  # alpha falls below even prompt lookup's threshold
            policy.observe("chat", 1, 0)
        probes = [policy.num_drafts("chat", batch_size=1) for _ in range(every)]
        assert probes == [0] * (every - 1) + [1]


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


def test_a_draft_models_own_cost_raises_the_bar_each_draft_must_clear():
    """A draft model's pass costs ``rho`` of the target's: a draft must be likelier than that to pay."""
    free, costly = DraftPolicy(4, 0.015), DraftPolicy(4, 0.015, draft_cost_ratio=0.37)
    assert costly.threshold(1) == pytest.approx(free.threshold(1) + 0.37)
    for policy in (free, costly):
        for _ in range(3):
            policy.observe("chat", 2, 1)  # alpha about 0.5
    assert free.num_drafts("chat", batch_size=1) == 4 and costly.num_drafts("chat", batch_size=1) == 1
    costly.observe("chat", 1, 0)
    costly.observe("chat", 1, 0)
    assert costly.num_drafts("chat", batch_size=1) == 0


def test_the_draft_cost_ratio_is_the_drafts_weights_per_token_over_the_targets(tiny_llama, tmp_path):
    """SmolLM2-135M's shape (30 layers, a 49,152-token head): its first 6 layers cost about 0.37 of it.
    The engine reads the ratio from the two checkpoints; n-gram lookup costs nothing."""
    from dataclasses import replace

    from shared.config import ModelConfig
    from stage5_server.config import EngineConfig
    from stage5_server.spec_decode import make_draft_policy
    from stage5_server.spec_decode.draft_checkpoint import write_layer_prefix_checkpoint
    from stage5_server.spec_decode.policy import forward_weights

    tiny = ModelConfig.from_pretrained(tiny_llama)
    smollm2 = replace(tiny, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152)
    layer = 576 * (2 * 576 + 2 * 192 + 3 * 1536)
    assert forward_weights(smollm2) == 30 * layer + 49152 * 576
    assert forward_weights(replace(smollm2, num_hidden_layers=6)) / forward_weights(smollm2) == \
        pytest.approx(0.368, abs=0.001)

    draft = write_layer_prefix_checkpoint(tiny_llama, tmp_path / "draft", 1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    policy = make_draft_policy(EngineConfig.create(model=str(tiny_llama), device="cpu", speculative_config=spec))
    expected = forward_weights(ModelConfig.from_pretrained(draft)) / forward_weights(tiny)
    assert policy.rho == pytest.approx(expected) and 0 < expected < 1
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    ngram_config = EngineConfig.create(model=str(tiny_llama), device="cpu", speculative_config=ngram)
    assert make_draft_policy(ngram_config).rho == 0


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
        assert llm.engine.drafter.policy is not None
        if name == "fixed":
            llm.engine.drafter.policy = None
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
        stats = llm.engine.stats()
        drafted[name] = (stats.spec_decoding.num_draft_tokens, stats.spec_decoding.num_accepted_tokens)
        if name == "adaptive":
            assert not llm.engine.drafter.policy.requests  # finished requests are forgotten
    assert drafted["adaptive"][0] < drafted["fixed"][0]
    rate = {name: accepted / max(tokens, 1) for name, (tokens, accepted) in drafted.items()}
    assert rate["adaptive"] >= rate["fixed"]
