"""Drive a scheduler with token ids alone: no model, no tensors."""

from __future__ import annotations

from shared import Request, SamplingParams


def make_request(rid: str, num_prompt: int, max_tokens: int = 100, priority: int = 0, arrival: float = 0.0,
                 eos=(), stop_token_ids=(), first_token: int = 1000) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=list(stop_token_ids))
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(rid, prompt, params, arrival_time=arrival, priority=priority, eos_token_ids=tuple(eos))


def run_step(scheduler, token: int = 7):
    """Schedule, 'execute' (every request that reaches its last token samples ``token``), update."""
    output = scheduler.schedule()
    sampled = {}
    for request in output.scheduled_reqs:
        n = output.num_scheduled_tokens[request.request_id]
        sampled[request.request_id] = [token] if request.num_computed_tokens + n == request.num_tokens else []
    scheduler.update_from_output(output, sampled)
    return output
