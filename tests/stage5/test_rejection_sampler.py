"""The rejection rule on its own: whatever distribution the drafts come from, the tokens it keeps
are distributed as the target's (a chi-square test on a small vocabulary with a deliberately bad
draft), greedy is the special case that keeps exactly the argmax, and a draft without
probabilities is a point mass."""

from __future__ import annotations

import torch

from shared import SamplingParams
from shared.request import Request
from shared.sampler import sample
from stage5_server.spec_decode.rejection_sampler import rejection_sample, target_probs

VOCAB = 6
TRIALS = 6000
# The 0.1% critical value of the chi-square distribution with VOCAB - 1 = 5 degrees of freedom.
CHI2_CRITICAL_5_DOF = 20.515


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_output_distribution_is_the_targets_even_with_a_bad_draft():
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                           [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
                           [0.30, 0.10, 0.10, 0.10, 0.10, 0.30]])
    draft = torch.tensor([[0.02, 0.03, 0.05, 0.10, 0.30, 0.50],  # mass where the target has little
                          [0.60, 0.20, 0.02, 0.02, 0.06, 0.10]])
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    accepted = 0
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(draft[i], 1, generator=generator)) for i in range(2)]
        tokens = rejection_sample(target, drafts, draft, generator)
        first[tokens[0]] += 1
        if len(tokens) > 1:  # the first draft was accepted: the second token is drawn at position 2
            second[tokens[1]] += 1
        accepted += len(tokens) - 1
    assert chi_square(first, target[0]) < CHI2_CRITICAL_5_DOF
    assert chi_square(second, target[1]) < CHI2_CRITICAL_5_DOF
    overlap = float(torch.minimum(target[0], draft[0]).sum())  # the chance the first draft is kept
    assert abs(float(second.sum()) / TRIALS - overlap) < 0.03
    assert 0 < accepted < TRIALS  # the bad draft is mostly rejected


def test_a_draft_without_probabilities_is_a_point_mass():
    generator = torch.Generator().manual_seed(1)
    target = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.05, 0.05], [1 / VOCAB] * VOCAB])
    counts, kept = torch.zeros(VOCAB), 0
    for _ in range(TRIALS):
        tokens = rejection_sample(target, [1], None, generator)
        counts[tokens[0]] += 1
        kept += len(tokens) == 2
    assert chi_square(counts, target[0]) < CHI2_CRITICAL_5_DOF
    assert abs(kept / TRIALS - 0.6) < 0.03  # accepted with probability p(draft)


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(dim=-1).tolist()
    requests = [Request("r", [1, 2, 3], SamplingParams(temperature=0))] * 4
    probs = target_probs(logits, requests)
    assert rejection_sample(probs, argmax[:3], None) == argmax
    assert rejection_sample(probs, [argmax[0], (argmax[1] + 1) % 50, argmax[2]], None) == argmax[:2]
    bad_q = torch.full((3, 50), 1 / 50)
    assert rejection_sample(probs, [(argmax[0] + 1) % 50] + argmax[1:3], bad_q) == argmax[:1]


def test_target_probs_honour_the_sampling_parameters_sample_uses():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(3))
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0.7, top_k=5, top_p=0.8, logit_bias={7: 3.0},
                                                    repetition_penalty=1.3, seed=5))
    request.output_token_ids = [4, 7]
    probs = target_probs(logits, [request])[0]
    assert 0 < int((probs > 0).sum()) <= 5 and abs(float(probs.sum()) - 1) < 1e-5
    draws = torch.zeros(40)
    for _ in range(2000):
        draws[sample(logits, [request], torch.Generator())[0]] += 1
    assert set(draws.nonzero().flatten().tolist()) <= set(probs.nonzero().flatten().tolist())
    support = probs > 0
    assert chi_square(draws[support], probs[support]) < 30  # at most 5 tokens: generous for 4 dof
