"""Speculative decoding on the real engine: drafts verified inside the token budget give exactly
the tokens of the same engine without them, through chunked prefill, preemption, prefix-cache
hits, ``n > 1``, stop strings, stop tokens and aborts, and no KV block is left behind.

A random tiny checkpoint rarely repeats itself, so prompt lookup would mostly propose nothing;
these tests replay each request's known continuation as its drafts instead (``ReplayProposer``,
a proposer like any other), with some drafts deliberately wrong, so that every step mixes
accepted and rejected drafts. The n-gram proposer itself runs the whole invariant suite
(``tests/conftest.py``, ``stage5_server-ngram``) and the default model below.
"""

from __future__ import annotations

import pytest

from shared import SamplingParams
from stage5_server import LLM
from stage5_server.core.stats import LoggingStatLogger
from stage5_server.spec_decode import NgramDrafter, NgramProposer

ENGINE = dict(device="cpu", dtype="float32", max_model_len=160, max_num_seqs=8, max_num_batched_tokens=16,
              block_size=4)
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           [5, 17, 42, 99, 7, 3, 250, 11, 64, 80, 81], [200, 201, 202]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class ReplayProposer:
    """Drafts the known continuation of whichever run the request's tokens begin; every third
    proposal gets its last draft wrong, every fifth its first."""

    def __init__(self, runs: list[list[int]], k: int = 3, vocab_size: int = 256):
        self.runs, self.k, self.vocab_size, self.calls = runs, k, vocab_size, 0

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        for run in self.runs:
            if len(run) > len(token_ids) and run[:len(token_ids)] == token_ids:
                drafts = run[len(token_ids):len(token_ids) + (self.k if k is None else k)]
                self.calls += 1
                for every, index in ((3, -1), (5, 0)):
                    if self.calls % every == 0:
                        drafts[index] = (drafts[index] + 1) % self.vocab_size
                return drafts
        return []


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def replaying(model, runs: list[list[int]], **engine) -> LLM:
    llm = LLM(str(model), **{**ENGINE, **engine})
    llm.engine.drafter = NgramDrafter(ReplayProposer(runs))
    return llm


def assert_no_block_held(llm: LLM) -> None:
    manager = llm.engine.scheduler.kv_cache_manager
    assert llm.engine.kv_cache_usage() == 0 and not manager.req_to_blocks
    assert manager.num_free_blocks == llm.engine.num_kv_blocks


def test_replayed_drafts_give_the_plain_tokens_through_chunked_prefill_preemption_and_prefix_hits(tiny_llama):
    plain = LLM(str(tiny_llama), **ENGINE)
    expected = generate(plain, PROMPTS * 2, GREEDY)
    runs = [p + e for p, e in zip(PROMPTS, expected)]
    tight = replaying(tiny_llama, runs, num_kv_blocks=20, max_model_len=64, enable_prefix_caching=True)
    assert generate(tight, PROMPTS * 2, GREEDY) == expected
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens  # some of each
    assert_no_block_held(tight)


def test_every_step_stays_inside_the_token_budget_with_drafts(tiny_llama):
    expected = generate(LLM(str(tiny_llama), **ENGINE), PROMPTS, GREEDY)
    llm = replaying(tiny_llama, [p + e for p, e in zip(PROMPTS, expected)], max_num_batched_tokens=10)
    llm.engine.step_trace = []
    assert generate(llm, PROMPTS, GREEDY) == expected
    assert all(sum(step.values()) <= 10 for step in llm.engine.step_trace)
    assert any(count > 1 for step in llm.engine.step_trace[3:] for count in step.values())  # decodes verified drafts


def test_a_rejected_draft_ends_the_check_even_if_a_later_draft_matches(tiny_llama):
    expected = generate(LLM(str(tiny_llama), **ENGINE), PROMPTS[:1], GREEDY)[0]
    llm = LLM(str(tiny_llama), **ENGINE)
    request_id = llm.add_request(PROMPTS[0], GREEDY)
    request = llm.engine.scheduler.requests[request_id]
    while request.num_output_tokens < 2:
        llm.step()
    n = request.num_output_tokens
    wrong = (expected[n] + 1) % 256
    llm.engine.scheduler.add_draft_tokens(request, [wrong, expected[n], expected[n + 1]])  # the 2nd equals the fix
    llm.step()
    assert request.output_token_ids == expected[:n + 1]


def test_seeded_sampling_with_drafts_samples_the_plain_tokens(tiny_llama):
    """One draw per token kept, from the request's own generator: the n-gram rule changes nothing."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True, n=2,
                            repetition_penalty=1.2, presence_penalty=0.3, logit_bias={9: 2.0})
    expected = generate(LLM(str(tiny_llama), **ENGINE), PROMPTS, params)
    runs = [PROMPTS[i // 2] + e for i, e in enumerate(expected)]
    llm = replaying(tiny_llama, runs)
    assert generate(llm, PROMPTS, params) == expected
    assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0


def test_stop_strings_and_stop_tokens_end_the_output_where_plain_decoding_ends_it(tiny_llama):
    plain = LLM(str(tiny_llama), **ENGINE)
    free = generate(plain, PROMPTS, GREEDY)
    texts = [plain.tokenizer.decode(tokens) for tokens in free]
    stops = [SamplingParams(temperature=0, max_tokens=24, stop=[text[len(text) // 2:len(text) // 2 + 3]])
             for text in texts]
    stop_tokens = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[12]]) for tokens in free]
    params = stops + stop_tokens
    expected = plain.generate(PROMPTS * 2, params, use_tqdm=False)
    llm = replaying(tiny_llama, [p + f for p, f in zip(PROMPTS, free)])
    got = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.outputs[0].finish_reason for o in got] == ["stop"] * len(params)
    assert all(len(o.outputs[0].token_ids) < 24 for o in got)
    assert_no_block_held(llm)


def test_max_tokens_cuts_the_drafts_and_logprobs_come_one_per_token(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)
    plain = LLM(str(tiny_llama), **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    runs = [p + o.outputs[0].token_ids + [1] * 10 for p, o in zip(PROMPTS, plain)]
    llm = replaying(tiny_llama, runs)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(got, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 7
        assert [list(e) for e in a.outputs[0].logprobs] == [list(e) for e in b.outputs[0].logprobs]
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert llm.engine.stats().spec_decoding.num_draft_tokens <= 6 * len(PROMPTS)  # never past max_tokens


def test_aborting_a_request_with_drafts_in_flight_frees_its_blocks(tiny_llama):
    expected = generate(LLM(str(tiny_llama), **ENGINE), PROMPTS, GREEDY)
    llm = replaying(tiny_llama, [p + e for p, e in zip(PROMPTS, expected)])
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    outputs = {}
    for _ in range(6):
        for out in llm.step():
            outputs[out.request_id] = out
    assert any(r.spec_token_ids for r in llm.engine.scheduler.running)  # drafts wait for the next step
    llm.abort(ids[1])
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id] = out
    for i in (0, 2, 3):
        assert outputs[ids[i]].outputs[0].token_ids == expected[i]
    assert_no_block_held(llm)


def test_acceptance_is_counted_per_position_and_shown_in_the_stats_line(tiny_llama):
    expected = generate(LLM(str(tiny_llama), **ENGINE), PROMPTS, GREEDY)
    llm = replaying(tiny_llama, [p + e for p, e in zip(PROMPTS, expected)])
    before = llm.engine.stats()
    generate(llm, PROMPTS, GREEDY)
    stats = llm.engine.stats()
    per_pos = stats.spec_decoding.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decoding.num_accepted_tokens and list(per_pos) == sorted(per_pos, reverse=True)
    assert stats.spec_decoding.num_draft_tokens <= 3 * stats.spec_decoding.num_drafts
    line = LoggingStatLogger.format_line(before, stats, 1.0)
    rate = stats.spec_decoding.num_accepted_tokens / stats.spec_decoding.num_draft_tokens
    length = 1 + stats.spec_decoding.num_accepted_tokens / stats.spec_decoding.num_drafts
    assert f"Spec decode acceptance rate: {100 * rate:.1f}%, mean acceptance length: {length:.2f}" in line
    assert "Spec decode" not in LoggingStatLogger.format_line(stats, stats, 1.0)  # nothing verified: nothing shown
    first = LoggingStatLogger(1.0)  # a server whose first interval already verified drafts
    assert "Spec decode acceptance rate" in first.maybe_log(stats, now=first.last_time + 1.0)


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "enum": ["a", "bb"]}},
          "required": ["id", "tag"]}
GRAMMARS = [{"json": SCHEMA}, {"regex": r"[0-9]{3}-[a-z]{2}"}, {"choice": ["red", "green", "blue"]}]


def test_drafts_under_a_grammar_are_verified_against_one_mask_per_position(tiny_llama):
    """Grammar requests take drafts too: the core sends a mask for each position that samples (the
    last token's and one after each draft), so the tokens are the plain constrained ones."""
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=g) for g in GRAMMARS]
    prompts = PROMPTS[:len(GRAMMARS)]
    expected = generate(LLM(str(tiny_llama), **ENGINE), prompts, params)
    llm = replaying(tiny_llama, [p + e for p, e in zip(prompts, expected)])
    assert generate(llm, prompts, params) == expected
    stats = llm.engine.stats()
    # Most wrong replayed drafts are ones the grammar forbids, cut before scheduling; how many of the
    # rest are rejected depends on when each grammar is built (in a thread), so only acceptance is fixed.
    assert stats.spec_decoding.num_accepted_tokens > 0
    assert stats.num_steps < sum(len(e) for e in expected)  # several tokens a step under the grammar


def test_a_draft_the_grammar_forbids_is_never_scheduled(tiny_llama):
    """Under ``[0-9]{3}-[a-z]{2}`` no letter may come before the dash: drafts of letters there are
    cut before they take a position; a valid draft prefix is kept and the forbidden rest dropped."""
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})
    llm = LLM(str(tiny_llama), **ENGINE)
    [plain] = generate(llm, [PROMPTS[0]], params)
    letter = llm.tokenizer.encode("x", add_special_tokens=False)
    assert len(letter) == 1

    class LetterProposer:  # the right digit, then letters; letters alone where the dash must come
        def propose(self, token_ids, k=None):
            done = len(token_ids) - len(PROMPTS[0])  # the tiny tokenizer spells the digits one by one
            return plain[done:done + 1] + letter * 2 if done < 3 else letter * 3 if done == 3 else []

    llm = LLM(str(tiny_llama), **ENGINE)
    llm.engine.drafter = NgramDrafter(LetterProposer())
    assert generate(llm, [PROMPTS[0]], params) == [plain]
    stats = llm.engine.stats()
    assert stats.spec_decoding.num_draft_tokens == stats.spec_decoding.num_accepted_tokens == 1


def test_ngram_engine_gives_the_plain_greedy_tokens_and_accepts_repeated_text(tiny_llama):
    """A prompt that repeats a long span: the tiny model's continuation is not a copy, but its drafts
    are scheduled and verified, and the output is the plain one."""
    prompts = [PROMPTS[1] * 3, PROMPTS[0] * 4]
    expected = generate(LLM(str(tiny_llama), **ENGINE), prompts, GREEDY)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    llm = LLM(str(tiny_llama), **ENGINE, speculative_config=spec)
    assert generate(llm, prompts, GREEDY) == expected
    assert llm.engine.stats().spec_decoding.num_drafts > 0


@pytest.mark.parametrize("tokens, expected", [
    ([1, 2, 3, 4, 1, 2], [3, 4, 1]),  # "1 2" occurred before: what followed it
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], [7, 2, 3]),  # the most recent of two occurrences
    ([5, 1, 2, 3, 8, 9, 1, 2, 3, 6, 2, 3], [6, 2, 3]),  # no 3-gram repeats; "2 3" most recently went on "6 2 3"
    ([1, 2, 3, 4], []),  # nothing repeats
    ([7, 7], [7]),  # only the one token that followed
])
def test_ngram_proposer_continues_the_most_recent_longest_match(tokens, expected):
    assert NgramProposer(3, 1, 3).propose(tokens) == expected


def test_ngram_proposer_prefers_a_longer_match_and_respects_its_bounds():
    tokens = [1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3]  # "3" alone last continued with 20; "1 2 3" with 10
    assert NgramProposer(2, 1, 3).propose(tokens) == [10, 11]
    assert NgramProposer(2, 1, 1).propose(tokens) == [20, 21]
    assert NgramProposer(2, 4, 5).propose(tokens) == []  # no 4-gram repeats
    assert NgramProposer(2, 1, 3).propose(tokens, k=1) == [10]


@pytest.mark.slow
def test_default_model_with_ngram_gives_the_plain_greedy_tokens_and_accepts_copies():
    text = ("The scheduler spends one token budget per step: decodes first, then chunks of the waiting "
            "prompts, and it preempts the newest request when the KV cache runs out of blocks.")
    messages = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                [{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=48)
    engine = dict(device="cpu", dtype="float32", max_model_len=512, max_num_batched_tokens=64, block_size=16)
    plain = [o.outputs[0].token_ids for o in LLM(**engine).chat(messages, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(**engine, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)] == plain
    stats = llm.engine.stats()
    assert stats.spec_decoding.num_accepted_tokens > 0.5 * stats.spec_decoding.num_draft_tokens  # the copy is drafted
