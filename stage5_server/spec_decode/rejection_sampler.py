"""Verify draft tokens so that the output is distributed exactly as the target model's.

A proposer guessed ``d_1 .. d_k``; one forward pass of the target model gave, at each of those
positions, the distribution ``p_i`` it would have sampled from (all the request's sampling
parameters applied: ``target_probs``), plus ``p_{k+1}`` after the last draft.
If the proposer drew ``d_i`` from a distribution ``q_i`` (a draft model that samples), the rule
of Leviathan et al. and Chen et al. (2023) is, position by position:

1. accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``, and go on;
2. on the first rejection, draw the replacement from the residual ``max(0, p_i - q_i)``,
   normalized, and stop: the later drafts were conditioned on a token that is gone;
3. when every draft is accepted, draw a bonus token from ``p_{k+1}``.

Each token kept is then a draw from ``p_i``: accepted with probability ``sum_x min(p(x), q(x))``,
and otherwise from exactly the mass that acceptance left out. So the request gains between 1 and
``k + 1`` tokens per step and its output distribution is the target's, whatever ``q`` is; a good
``q`` only makes acceptance likelier.

Two special cases follow from the same rule:

- a draft with no probabilities (n-gram, or a draft model that proposes greedily) is a point
  mass ``q_i = 1`` at ``d_i``: accept with probability ``p_i(d_i)``, else draw from ``p_i`` with
  ``d_i`` taken out. That is the same as drawing ``x ~ p_i`` and keeping the draft while
  ``x == d_i`` (the runner's accept-while-equal loop), which also spends one draw per token kept,
  so a seeded request samples the very tokens it samples without speculation;
- greedy sampling makes ``p_i`` a point mass at the argmax: a draft is accepted exactly when it is
  the argmax, and the output is token for token plain greedy decoding.

vLLM: ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler``; ``draft_probs=None`` is its
n-gram and EAGLE case).
"""

from __future__ import annotations

import torch

from shared.sampler import apply_logits_processors, sampling_probs


def target_probs(logits: torch.Tensor, requests: list) -> torch.Tensor:
    """The distribution ``shared.sampler.sample`` draws each row's token from: its logits processors, then
    a greedy row's argmax as a point mass, a sampled row's ``sampling_probs``."""
    logits = apply_logits_processors(logits.to("cpu", torch.float32), requests)
    probs = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if random_rows:
        probs[random_rows] = sampling_probs(logits[random_rows], [requests[i] for i in random_rows])
    return probs


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """One request's tokens for this step: the accepted drafts, then one more.

    ``target_probs [k + 1, vocab]``: the target's distribution at each draft position and after the
    last; ``draft_probs [k, vocab]`` the distributions the drafts were drawn from, or None (point masses).
    """
    tokens: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        p = target_probs[i]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        u = float(torch.rand((), generator=generator))
        if u * q_draft < float(p[draft]):  # u < p / q: accepted with probability min(1, p / q)
            tokens.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: nothing is left out, draw from p
            residual = p
        tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
        return tokens
    tokens.append(int(torch.multinomial(target_probs[len(draft_token_ids)], 1, generator=generator)))
    return tokens
