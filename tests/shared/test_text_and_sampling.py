"""Tokenizer, incremental detokenizer, sampler and timelines."""

from __future__ import annotations

import pytest
import torch

from shared import IncrementalDetokenizer, Request, RequestTimeline, SamplingParams, Tokenizer, goodput
from shared.sampler import sample


def test_incremental_detokenizer_never_emits_half_a_character(tiny_llama):
    tok = Tokenizer(tiny_llama)
    text = "Café 東京 🙂 Привет 🚀 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add_tokens([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens were held back mid-character


def _request(params, rid="r"):
    return Request(rid, [1, 2, 3], params)


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.0, top_k=1, seed=1),
                   SamplingParams(temperature=1.0, top_p=1e-6, seed=1)):
        reqs = [_request(params, str(i)) for i in range(4)]
        assert sample(logits, reqs, torch.Generator().manual_seed(0)) == argmax


def test_a_vanishing_temperature_decodes_greedily_and_an_infinite_one_is_refused():
    """1e-300 would overflow logits / temperature to inf (a NaN softmax): below vLLM's 1e-5 it is greedy."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 30
    reqs = [_request(SamplingParams(temperature=t, seed=2), str(i)) for i, t in enumerate((1e-300, 5e-324, 1e-6))]
    assert sample(logits, reqs, torch.Generator().manual_seed(0)) == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    req = _request(SamplingParams(temperature=1.0, seed=5))
    counts = [0, 0, 0]
    for _ in range(2000):
        counts[sample(logits, [req], torch.Generator())[0]] += 1
    assert 1250 < counts[0] < 1550 and 250 < counts[1] < 550 and 100 < counts[2] < 300


def test_top_k_never_samples_outside_the_k_best():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    req = _request(SamplingParams(temperature=2.0, top_k=2, seed=0))
    assert {sample(logits, [req], torch.Generator())[0] for _ in range(300)} == {0, 1}


def test_timeline_derives_ttft_itl_tpot_and_single_token_has_no_tpot():
    t = RequestTimeline(arrival=10.0, first_scheduled=10.5, token_times=[11.0, 11.2, 11.6], finished=11.6)
    assert t.ttft == 1.0 and t.queue_time == 0.5 and round(t.e2e, 6) == 1.6
    assert [round(x, 6) for x in t.itls] == [0.2, 0.4] and round(t.tpot, 6) == 0.3
    assert RequestTimeline(arrival=0.0, token_times=[1.0]).tpot is None


def test_goodput_divides_passing_completions_by_the_window_not_by_completions():
    assert goodput(550, 100.0) == 5.5  # the seed's candidate A, not 550/600*1000/100 = 9.17
    assert goodput(752, 100.0) == 7.52
    assert goodput(0, 100.0) == 0


def test_decode_equals_transformers_decode_including_special_tokens(checkpoints):
    for path in checkpoints.values():
        tok = Tokenizer(path)
        ids = tok.encode("Hello, world! Café 東京") + [0, 1, 2] + tok.encode(" more text")
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_min_p_top_k_and_top_p_keep_the_tokens_transformers_warpers_keep():
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from shared.sampler import apply_min_p, apply_top_k_top_p

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    ids = torch.zeros(6, 1, dtype=torch.long)
    kept = lambda x: torch.isfinite(x)  # noqa: E731
    for min_p in (0.01, 0.1, 0.5):
        ours = apply_min_p(logits, torch.full((6,), min_p))
        assert torch.equal(kept(ours), kept(MinPLogitsWarper(min_p)(ids, logits.clone())))
    for top_k in (1, 5, 50):
        ours = apply_top_k_top_p(logits, torch.full((6,), top_k), None)
        assert torch.equal(kept(ours), kept(TopKLogitsWarper(top_k)(ids, logits.clone())))
    for top_p in (0.05, 0.5, 0.9):
        ours = apply_top_k_top_p(logits, None, torch.full((6,), top_p))
        assert torch.equal(kept(ours), kept(TopPLogitsWarper(top_p)(ids, logits.clone())))
    # Per row: a row at top_k = vocab and top_p = 1 keeps everything.
    mixed = apply_top_k_top_p(logits[:2], torch.tensor([3, 300]), torch.tensor([1.0, 1.0]))
    assert kept(mixed).sum(dim=-1).tolist() == [3, 300]


def test_penalties_follow_the_openai_and_repetition_formulas():
    from shared.sampler import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    req = _request(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    req.prompt_token_ids = [0]
    for token in (1, 1, 2):
        req.append_output_token(token)
    out = apply_penalties(logits, [req])[0].tolist()
    # 0: prompt only -> 2 / 2; 1: output twice -> -1 * 2 - 2 * 0.5 - 0.25; 2: output once -> 0.5 / 2 - 0.5 - 0.25
    assert out == pytest.approx([1.0, -3.25, -0.5, 3.0, -2.0])


def test_min_tokens_bias_and_bad_words_act_before_the_argmax():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0  # the greedy choice
    min_tokens = Request("a", [1], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]), eos_token_ids=(0,))
    bias = Request("b", [1], SamplingParams(temperature=0, logit_bias={7: 6.0}))
    bad = Request("c", [1], SamplingParams(temperature=0), bad_words_token_ids=[[9, 4], [4]])
    tokens = sample(logits, [min_tokens, bias, bad], torch.Generator())
    assert tokens[0] not in (0, 4) and tokens[1] == 7 and tokens[2] != 4


def test_a_bad_word_is_banned_as_written_and_after_a_space(tiny_llama):
    from shared.sampler import banned_by_bad_words
    from shared.sampling_params import tokenize_bad_words

    tok = Tokenizer(tiny_llama)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    for word in ("the", "cache", "blocks"):
        plain, spaced = encode(word), encode(" " + word)
        expected = [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])
        assert tokenize_bad_words([word], encode) == expected
    word = encode("blocks")
    req = Request("r", [5, 6], SamplingParams(), bad_words_token_ids=[word])
    for token in word[:-1]:
        req.append_output_token(token)
    assert banned_by_bad_words(req) == [word[-1]]
    fresh = Request("s", word[:-1], SamplingParams(), bad_words_token_ids=[word])  # prefix in the prompt only
    assert banned_by_bad_words(fresh) == []


def test_a_batch_of_plain_greedy_rows_is_the_argmax_of_the_logits_as_given():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2), dtype=torch.bfloat16)
    reqs = [_request(SamplingParams(temperature=0), str(i)) for i in range(4)]
    assert sample(logits, reqs, torch.Generator()) == logits.argmax(-1).tolist()


def test_detokenize_false_gives_the_same_token_ids_and_no_text(tiny_llama):
    from stage4_prefix_cache import LLM

    llm = LLM(str(tiny_llama), block_size=4, max_model_len=64)
    prompts = [[5, 9, 200, 31], "Hello there"]
    with_text = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ids_only = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ids_only] == [o.outputs[0].token_ids for o in with_text]
    assert all(o.outputs[0].text for o in with_text) and not any(o.outputs[0].text for o in ids_only)
    with pytest.raises(ValueError, match="^stop: stop strings need the text"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="^detokenize: must be a bool"):
        SamplingParams(detokenize=1)
