"""Driving the scheduler with token ids alone: no model, no tensors.

The scheduler never looks at logits, so a step can be "executed" by hand: every request
whose scheduled tokens reach its last known token samples a made-up token, and one still in
the middle of a chunked prefill samples nothing. Tests, the notebooks and the docs' traces
drive the real ``Scheduler`` this way, so what they show is what the engine would schedule.
"""

from __future__ import annotations

from stage3_continuous.scheduler import Scheduler, SchedulerOutput


def dry_run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule one step, sample ``token`` for every request that finishes its known tokens, update."""
    output = scheduler.schedule()
    sampled = {}
    for request in output.scheduled_reqs:
        num_new = output.num_scheduled_tokens[request.request_id]
        sampled[request.request_id] = [token] if request.num_computed_tokens + num_new == request.num_tokens else []
    scheduler.update_from_output(output, sampled)
    return output


def describe_step(output: SchedulerOutput, budget: int) -> str:
    """``"R0 decode 1, R1 prefill 5; used 6/6"`` for a step that has run (after ``update_from_output``)."""
    parts = []
    for request in output.scheduled_reqs:
        num_new = output.num_scheduled_tokens[request.request_id]
        computed_before = request.num_computed_tokens - num_new
        kind = "prefill" if computed_before < request.num_prompt_tokens else "decode"
        parts.append(f"{request.request_id} {kind} {num_new}")
    return f"{', '.join(parts)}; used {output.total_num_scheduled_tokens}/{budget}"
