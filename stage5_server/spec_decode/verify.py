"""Verify a step's draft tokens: each request's list of tokens for the step, from the target's logits.

The runner computed logits at every position that samples: a request's last known position and one
per draft after it (``first_rows[i]`` is request i's first row). ``verify`` gives each request a *list*
of tokens, one call per step:

- a request without drafts samples one token, as plain decoding does;
- a request whose drafts came without probabilities (n-gram, or a greedy draft model) samples at each
  position in turn, each with the outputs so far extended by the drafts before it, and keeps going
  while the token it samples equals the draft: the list is the accepted drafts and then the first
  token that differs (or one past the last draft). Every token kept is a draw from the target's own
  distribution given the tokens before it, so the output is what plain decoding gives (token for
  token under greedy), and a seeded request draws exactly as it would without drafts;
- a request whose drafts a draft model sampled from ``q`` is verified by the rejection rule against
  the target's distribution at each position (``rejection_sampler.py``).

The rejected positions' KV is simply overwritten later: the scheduler rolls ``num_computed_tokens``
back past them.

vLLM: ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler``: the accept-while-equal rule is its
case without ``draft_probs``).
"""

from __future__ import annotations

import torch

from shared.sampler import gather_logprobs, sample
from stage5_server.spec_decode.rejection_sampler import rejection_sample, target_probs


def verify(logits: torch.Tensor, states: list, drafts: list[list[int]], first_rows: list[int],
           draft_probs: list[torch.Tensor | None], generator: torch.Generator) -> list[list[int]]:
    """Each request's tokens for this step (``states``: the runner's request states, as the sampler reads
    them; ``draft_probs[i]``: the distributions request i's drafts were drawn from, or None)."""
    point = [i for i, q in enumerate(draft_probs) if q is None]  # no drafts, or drafts without probabilities
    sampled: list[list[int]] = [[] for _ in states]
    for i, token in zip(point, sample(logits[[first_rows[i] for i in point]], [states[i] for i in point],
                                      generator)):
        sampled[i] = [token]
    accept_while_equal(states, drafts, first_rows, logits, sampled, generator)
    for i, q in enumerate(draft_probs):
        if q is not None:
            sampled[i] = rejection_sample_request(states[i], drafts[i], q, logits[first_rows[i]:][:len(q) + 1],
                                                  generator)
    return sampled


def accept_while_equal(states: list, drafts: list[list[int]], first_rows: list[int], logits: torch.Tensor,
                       sampled: list[list[int]], generator: torch.Generator) -> None:
    """Extend each request's list while its sampled token equals the next draft (module docstring); a
    request whose list is still empty is verified by the rejection rule instead."""
    num_outputs = [state.num_output_tokens for state in states]
    for position in range(1, max(map(len, drafts), default=0) + 1):
        # Still verifying: every draft before this one was accepted (its list has one token per position so
        # far), and the token sampled at the last position is the next draft.
        active = [i for i, tokens in enumerate(sampled) if len(drafts[i]) >= position
                  and len(tokens) == position and tokens[-1] == drafts[i][position - 1]]
        if not active:
            break
        for i in active:  # the sampler sees the drafts accepted so far as outputs
            states[i].output_token_ids.append(drafts[i][position - 1])
        tokens = sample(logits[[first_rows[i] + position for i in active]], [states[i] for i in active], generator)
        for i, token in zip(active, tokens):
            sampled[i].append(token)
    for state, before in zip(states, num_outputs):  # the core sends the real outputs next step
        del state.output_token_ids[before:]


def rejection_sample_request(state, drafts: list[int], draft_probs: torch.Tensor, logits: torch.Tensor,
                             generator: torch.Generator) -> list[int]:
    """Sampled drafts: the rejection rule against the target's distribution at each position (each
    computed with the drafts before it as outputs, for the penalties), plus logprobs if asked."""
    before = len(state.output_token_ids)
    targets = []
    for j in range(len(drafts) + 1):
        targets.append(target_probs(logits[j:j + 1], [state])[0])
        if j < len(drafts):
            state.output_token_ids.append(drafts[j])
    del state.output_token_ids[before:]
    tokens = rejection_sample(torch.stack(targets), drafts, draft_probs, state.generator or generator)
    if state.sampling_params.logprobs is not None:
        raw = logits[:len(tokens)].to("cpu", torch.float32).log_softmax(dim=-1)
        num_top = [state.sampling_params.logprobs] * len(tokens)
        state.logprobs.extend(gather_logprobs(raw, torch.tensor(tokens), num_top))
    return tokens
