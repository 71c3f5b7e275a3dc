"""Sampling parameters beyond temperature, top-k and top-p, parallel sampling and prompt logprobs.

Where transformers has the same logits processor, the tokens must be the ones its greedy
``generate`` picks with that processor; the OpenAI presence and frequency penalties have no
transformers processor, so a few lines here state the formula and play that part.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from shared import SamplingParams, Tokenizer
from shared.sampling_params import tokenize_bad_words
from tests.invariants.prompts import PROMPTS, encode_all, hf_generate, hf_greedy, hf_prompt_logprobs

MAX_TOKENS = 16


class OpenAIPenalties(LogitsProcessor):
    """``logit -= frequency * count + presence * (count > 0)`` over the generated tokens (OpenAI's definition)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def _cases(ids: tuple[int, ...], free_run: list[int], tokenizer):
    """(our SamplingParams, transformers' processors in vLLM's order, transformers' eos) for one prompt,
    each chosen to change that prompt's free greedy run."""
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    first_new = next(t for t in free_run if t != ids[-1])
    # A word the free run writes, as text for us and as the token sequences it stands for for
    # transformers. vLLM matches bad words in the output only, transformers in prompt + output: no
    # sequence may start with the prompt's last token, or the two would differ at the first step.
    word, sequences = _word_in(free_run[1:], encode, tokenizer, avoid_first=ids[-1])
    stop_at = free_run[2]
    # Penalties below 1 and below 0 reward repeats: on a random model they change the output for sure.
    yield SamplingParams(**greedy, repetition_penalty=0.4), [RepetitionPenaltyLogitsProcessor(0.4)], None
    yield (SamplingParams(**greedy, presence_penalty=-2, frequency_penalty=-0.5),
           [OpenAIPenalties(len(ids), -2, -0.5)], None)
    yield (SamplingParams(**greedy, logit_bias={first_new: -100.0, 7: 4.0}),
           [SequenceBiasLogitsProcessor([[[first_new], -100.0], [[7], 4.0]])], None)
    yield SamplingParams(**greedy, bad_words=[word]), [NoBadWordsLogitsProcessor(sequences)], None
    # min_tokens holds back the stop tokens and EOS (ids 0 and 2 in the tiny checkpoints) alike.
    yield (SamplingParams(**greedy, stop_token_ids=[stop_at], min_tokens=6),
           [MinNewTokensLengthLogitsProcessor(len(ids), 6, [stop_at, 0, 2])], [stop_at])
    everything = SamplingParams(**greedy, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                                logit_bias={free_run[1]: -3.0}, min_tokens=4, stop_token_ids=[stop_at],
                                bad_words=[word])
    yield everything, [NoBadWordsLogitsProcessor(sequences),
                       MinNewTokensLengthLogitsProcessor(len(ids), 4, [stop_at, 0, 2]),
                       SequenceBiasLogitsProcessor([[[free_run[1]], -3.0]]), RepetitionPenaltyLogitsProcessor(1.3),
                       OpenAIPenalties(len(ids), 0.5, 0.4)], [stop_at]


def _word_in(tokens: list[int], encode, tokenizer, avoid_first: int) -> tuple[str, list[list[int]]]:
    """Text made by one or two of ``tokens`` that bans that very sequence."""
    for length in (2, 1):
        for i in range(len(tokens) - length + 1):
            window = tokens[i:i + length]
            text = tokenizer.decode(window)
            if "\ufffd" in text or not text.strip():
                continue
            sequences = tokenize_bad_words([text], encode)
            if window in sequences and all(len(s) == 1 or s[0] != avoid_first for s in sequences):
                return text, sequences
    raise AssertionError("no usable word in this run")


@functools.cache
def _reference_runs(model_path: Path) -> list[tuple[list[int], SamplingParams, list[int], list[int]]]:
    """(prompt ids, params, transformers' tokens, the free greedy run) for every case of every prompt."""
    tokenizer = Tokenizer(model_path)
    prompt_ids = encode_all(model_path)
    free_runs = hf_greedy(model_path, prompt_ids, MAX_TOKENS)
    return [(list(ids), params, hf_generate(model_path, ids, MAX_TOKENS, processors, eos_token_id=eos), free_run)
            for ids, free_run in zip(prompt_ids, free_runs)
            for params, processors, eos in _cases(ids, free_run, tokenizer)]


def test_penalties_bias_bad_words_and_min_tokens_match_transformers_greedy(stage, tiny_llama):
    """Every case of every prompt runs in one batch: each row's processors stay in its row."""
    runs = _reference_runs(tiny_llama)
    assert all(expected != free_run for _, _, expected, free_run in runs)  # every case changes the output
    outputs = stage.make_llm(tiny_llama).generate([r[0] for r in runs], [r[1] for r in runs], use_tqdm=False)
    for (_, params, expected, _), out in zip(runs, outputs):
        assert out.outputs[0].token_ids == expected, params


def test_n_fans_out_into_seeded_children_merged_in_index_order(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    params = SamplingParams(n=3, temperature=0.9, top_k=40, max_tokens=8, seed=11, ignore_eos=True, logprobs=1)
    [out] = llm.generate(PROMPTS[1], params, use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    alone = [llm.generate(PROMPTS[1], SamplingParams(temperature=0.9, top_k=40, max_tokens=8, seed=11 + i,
                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
             for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone  # child i samples with seed + i, as vLLM's
    assert all(len(c.logprobs) == 8 for c in out.outputs)
    unseeded = llm.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(n=4, temperature=1.0, max_tokens=6),
                            use_tqdm=False)
    assert [len(o.outputs) for o in unseeded] == [4, 4]
    assert len({tuple(c.token_ids) for c in unseeded[0].outputs}) > 1
    with pytest.raises(ValueError, match="^n:"):
        SamplingParams(n=2, temperature=0)
    assert llm.engine.kv_cache_usage() == 0


def test_aborting_a_parallel_sampling_request_aborts_every_child(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    parent = llm.add_request(PROMPTS[0], SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    llm.step()
    streamed = llm.step()
    assert [o.request_id for o in streamed] == [parent] * len(streamed) and streamed
    llm.abort(parent)
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.engine.kv_cache_usage() == 0


def test_prompt_logprobs_match_transformers_across_prefill_chunks(stage, tiny_llama):
    """The invariant suite's stage 3+ budget (16 tokens) splits the 40-token prompt into chunks."""
    llm = stage.make_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    for ids, out in zip(encode_all(tiny_llama), outputs):
        expected = hf_prompt_logprobs(tiny_llama, ids)
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for position, (token, entry) in enumerate(zip(ids[1:], entries[1:])):
            row = expected[position]
            assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = sorted((lp for t, lp in entry.items() if lp.rank <= 3), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top][:3] == [1, 2, 3][:len(top)]
            assert all(math.isclose(lp.logprob, v, abs_tol=1e-4) for lp, v in zip(top, row.topk(3).values.tolist()))
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, (ids,), 2)[0]
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
