"""A draft model proposes, the target verifies: greedy output is exactly the target's alone, through
chunked prefill, preemption, prefix-cache hits, ``n > 1``, stop strings and aborts, and the draft's
own KV cache, indexed by the target's block tables, stays right through all of them.

Two drafts on the tiny random checkpoint: the target itself (every draft must then be accepted,
which holds only if the draft's KV cache is exactly the target's at every position it reads) and
its first layer with its head (``stage5_server/spec_decode/draft_checkpoint.py``: some drafts accepted, most not).
"""

from __future__ import annotations

import pytest

from course.tiny_model import make_tiny_model
from shared import SamplingParams
from stage5_server import LLM
from stage5_server.spec_decode.draft_checkpoint import write_layer_prefix_checkpoint
from tests.stage5.test_spec_decode import ENGINE, GREEDY, PROMPTS, assert_no_block_held, generate


@pytest.fixture(scope="module")
def one_layer_draft(tiny_llama, tmp_path_factory):
    return write_layer_prefix_checkpoint(tiny_llama, tmp_path_factory.mktemp("draft") / "one-layer", 1)


def drafting(target, draft, k: int = 3, policy: bool = False, **engine) -> LLM:
    """An engine drafting with ``draft``; without the draft-length policy (``policy=False``) every
    request drafts ``k`` every step, which these tests want even from drafts that do not pay."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    llm = LLM(str(target), **{**ENGINE, **engine}, speculative_config=spec)
    if not policy:
        llm.engine.drafter.policy = None
    return llm


def test_the_target_as_its_own_draft_has_every_draft_accepted_through_preemption_and_prefix_hits(tiny_llama):
    expected = generate(LLM(str(tiny_llama), **ENGINE), PROMPTS * 2, GREEDY)
    llm = drafting(tiny_llama, tiny_llama, num_kv_blocks=24, max_model_len=64, enable_prefix_caching=True)
    assert generate(llm, PROMPTS * 2, GREEDY) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decoding.num_draft_tokens > 20
    assert stats.spec_decoding.num_accepted_tokens == stats.spec_decoding.num_draft_tokens
    assert_no_block_held(llm)


@pytest.mark.parametrize("engine", [dict(max_num_batched_tokens=6, block_size=2),
                                    dict(num_kv_blocks=20, max_model_len=48, enable_prefix_caching=True)],
                         ids=["chunked-small-blocks", "preempted-and-cached"])
def test_a_one_layer_draft_gives_the_plain_greedy_tokens(tiny_llama, one_layer_draft, engine):
    """Block size 2 with k = 4: the proposal runs past a request's blocks into two scratch blocks."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]  # the first two share a prefix
    expected = generate(LLM(str(tiny_llama), **{**ENGINE, **engine}), prompts, params)
    llm = drafting(tiny_llama, one_layer_draft, k=4, **engine)
    llm.engine.drafter.policy = None  # draft k every step, however many are rejected
    assert generate(llm, prompts, params) == expected
    stats = llm.engine.stats()
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens
    assert_no_block_held(llm)


def test_sampled_drafts_follow_the_seed_and_are_checked_by_the_rejection_rule(tiny_llama, one_layer_draft):
    """A sampling request drafts by drawing from the draft's own distribution (no longer a point mass),
    so its tokens are not the plain engine's for the same seed; they follow the seed, and only part of
    the drafts survive the rule."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, n=2)
    first = generate(drafting(tiny_llama, one_layer_draft), PROMPTS[:2], params)
    llm = drafting(tiny_llama, one_layer_draft)
    assert generate(llm, PROMPTS[:2], params) == first
    stats = llm.engine.stats()
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens


CHI2_CRITICAL_2_DOF = 13.816  # the 0.1% critical value with 3 - 1 degrees of freedom


def test_a_verified_token_from_sampled_drafts_is_distributed_as_the_target_says(tiny_llama, one_layer_draft):
    """The rejection rule end to end: 600 seeds, top-k 3, one draft from the one-layer model for the
    second token; its counts (given the commonest first token) against the target's own distribution,
    computed by transformers, by a chi-square test; and the drafts kept as often as the rule keeps
    them, ``sum(min(p, q))`` (a point-mass check, ``p(draft)``, would be exact too, but keep fewer)."""
    from collections import Counter

    import torch
    from transformers import AutoModelForCausalLM

    from tests.stage5.test_rejection_sampler import chi_square

    prompt = PROMPTS[0]
    llm = drafting(tiny_llama, one_layer_draft, k=1, max_num_seqs=64, max_num_batched_tokens=1024)
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s) for s in range(600)]
    outputs = generate(llm, [prompt] * len(params), params)
    stats = llm.engine.stats()
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens  # both ways of the rule
    first, _ = Counter(o[0] for o in outputs).most_common(1)[0]
    seconds = Counter(o[1] for o in outputs if o[0] == first)

    def top3(checkpoint, token: int) -> torch.Tensor:  # the distribution after prompt + [token], top-k 3
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [token]])).logits[0, -1]
        top = logits.topk(3)
        return torch.zeros_like(logits).scatter_(0, top.indices, top.values.softmax(dim=-1))

    target = top3(tiny_llama, first)
    assert {t for t in seconds if target[t] == 0} == set()
    observed = torch.tensor([float(seconds.get(t, 0)) for t in target.nonzero().flatten().tolist()])
    assert chi_square(observed, target[target > 0]) < CHI2_CRITICAL_2_DOF, observed
    firsts = Counter(o[0] for o in outputs)
    kept = sum(n * float(torch.minimum(top3(tiny_llama, t), top3(one_layer_draft, t)).sum()) for t, n in firsts.items())
    rate = stats.spec_decoding.num_accepted_tokens / stats.spec_decoding.num_draft_tokens
    assert abs(rate - kept / len(outputs)) < 0.05, (rate, kept / len(outputs))  # 3 sigma at n = 600


def test_stop_strings_and_aborts_end_where_plain_decoding_ends(tiny_llama):
    plain = LLM(str(tiny_llama), **ENGINE)
    free = generate(plain, PROMPTS, GREEDY)
    texts = [plain.tokenizer.decode(tokens) for tokens in free]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[t[len(t) // 2:len(t) // 2 + 3]]) for t in texts]
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    llm = drafting(tiny_llama, tiny_llama)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.outputs[0].finish_reason for o in got] == ["stop"] * len(params)
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    outputs = {}
    for _ in range(6):
        outputs.update({out.request_id: out for out in llm.step()})
    assert any(r.spec_token_ids for r in llm.engine.scheduler.running)
    llm.abort(ids[1])
    while llm.has_unfinished_requests():
        outputs.update({out.request_id: out for out in llm.step()})
    assert [outputs[ids[i]].outputs[0].token_ids for i in (0, 2, 3)] == [free[i] for i in (0, 2, 3)]
    assert_no_block_held(llm)


def test_the_drafts_kv_is_counted_in_the_pool_so_fewer_blocks_fit(tiny_llama, one_layer_draft):
    memory = 1 << 20
    alone = LLM(str(tiny_llama), **{**ENGINE, "kv_cache_memory": memory}).engine.num_kv_blocks
    with_draft = drafting(tiny_llama, one_layer_draft, kv_cache_memory=memory).engine.num_kv_blocks
    layers = LLM(str(tiny_llama), **ENGINE).engine.config.model_config.num_hidden_layers
    assert with_draft == pytest.approx(alone * layers / (layers + 1), abs=1)


def test_a_draft_with_another_vocabulary_is_refused_before_loading(tiny_llama, tmp_path):
    other = make_tiny_model(tmp_path / "other", vocab_size=384)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary has 384"):
        drafting(tiny_llama, other)


def test_the_policy_asks_the_workers_for_fewer_drafts_from_a_poor_draft(tiny_llama, one_layer_draft):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = generate(LLM(str(tiny_llama), **ENGINE), PROMPTS, params)
    drafted = []
    for policy in (False, True):
        llm = drafting(tiny_llama, one_layer_draft, k=4, policy=policy)
        assert generate(llm, PROMPTS, params) == expected
        drafted.append(llm.engine.stats().spec_decoding.num_draft_tokens)
    assert drafted[1] < drafted[0]


@pytest.mark.slow
def test_default_model_drafted_by_itself_and_by_its_first_layers_gives_the_plain_greedy_tokens(tmp_path):
    """Self-speculation on the default model: all 30 layers accept every draft; its first 6 layers with
    its head (no early-exit training) rarely agree with it, and the output is the plain one either way."""
    from shared.named_models import default_model

    messages = [[{"role": "user", "content": "Repeat exactly: the scheduler spends one token budget per step."}],
                [{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=24)
    engine = dict(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=32, block_size=16)
    plain = [o.outputs[0].token_ids for o in LLM(**engine).chat(messages, params, use_tqdm=False)]
    for layers in (30, 6):
        draft = write_layer_prefix_checkpoint(default_model(), tmp_path / f"draft{layers}", layers)
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        llm = LLM(**engine, speculative_config=spec)
        llm.engine.drafter.policy = None
        assert [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)] == plain
        stats = llm.engine.stats()
        if layers == 30:
            assert stats.spec_decoding.num_accepted_tokens == stats.spec_decoding.num_draft_tokens > 0
