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
