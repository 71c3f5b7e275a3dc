"""Requests for driving a scheduler with token ids alone (``stage3_continuous.dry_run``): no model, no tensors."""

from __future__ import annotations

from shared import Request, SamplingParams


def make_request(rid: str, num_prompt: int, max_tokens: int = 100, priority: int = 0, arrival: float = 0.0,
                 eos=(), stop_token_ids=(), first_token: int = 1000) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=list(stop_token_ids))
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(rid, prompt, params, arrival_time=arrival, priority=priority, eos_token_ids=tuple(eos))
