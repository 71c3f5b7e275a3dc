"""The engine core's drafter: which draft tokens each request carries into its next step.

With speculative decoding on, the engine core owns a ``Drafter`` and calls it twice a step:

- ``before_step``: a draft model runs on the workers, right after the target's forward pass
  (``draft_model.py``), so the core tells them, with the step, how many drafts each request should
  get (``SchedulerOutput.num_drafts_to_propose``);
- ``propose``, once the step's tokens are appended: the draft-length policy learns how many of each
  request's drafts were accepted (``policy.py``), and every request that goes on gets its next drafts,
  as many as its recent acceptance says pay at this batch size. ``NgramDrafter`` looks them up in the
  request's own tokens here, in the core (``ngram_proposer.py``); ``DraftModelDrafter`` takes the ones
  the workers sent back with the step's output.

The scheduler verifies the drafts in the request's next decode, inside the one token budget
(``core/scheduler.py``); the runner keeps those the target agrees with (``verify.py``).

vLLM: the proposers the model runner holds (``self.drafter`` in ``vllm/v1/worker/gpu_model_runner.py``:
``NgramProposer``, ``EagleProposer``, ``DraftModelProposer``), and the drafts the scheduler takes in
``update_draft_token_ids`` (``vllm/v1/core/sched/scheduler.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol

from stage5_server.spec_decode.policy import DraftPolicy

if TYPE_CHECKING:
    from shared.request import Request
    from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput


class TokenProposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]: ...


class Drafter:
    def __init__(self, policy: DraftPolicy | None = None):
        self.policy = policy  # how many drafts pay; None: always k

    def before_step(self, scheduler_output: SchedulerOutput, batch_size: int) -> None:
        """Tell the workers what they should draft after this step (a draft model's)."""

    def propose(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                running: list[Request], finished: list[str], live: Collection[str],
                batch_size: int) -> list[tuple[Request, list[int]]]:
        """Learn from the step's verifications, then the next drafts of each request in ``running`` (those that
        gained tokens and go on). ``finished``: the step's finished requests; ``live``: every request the core
        holds (the policy forgets the others)."""
        policy = self.policy
        if policy is not None:
            sampled = runner_output.by_request()
            for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                if sampled.get(request_id):  # none: aborted while its step ran
                    policy.observe(request_id, len(drafts), len(sampled[request_id]) - 1)
            for request_id in finished:
                policy.forget(request_id)
            if len(policy.requests) > 2 * len(live) + 64:  # aborted requests' entries
                for request_id in [r for r in policy.requests if r not in live]:
                    policy.forget(request_id)
        proposals = []
        for request in running:
            drafts = self.draft(request, runner_output, batch_size)
            if drafts:
                proposals.append((request, drafts))
        return proposals

    def draft(self, request: Request, runner_output: ModelRunnerOutput, batch_size: int) -> list[int]:
        raise NotImplementedError

    def num_drafts(self, request_id: str, batch_size: int) -> int | None:
        """The policy's draft length for ``request_id``; None: the proposer's own ``k``."""
        return None if self.policy is None else self.policy.num_drafts(request_id, batch_size)


class NgramDrafter(Drafter):
    def __init__(self, proposer: TokenProposer, policy: DraftPolicy | None = None):
        super().__init__(policy)
        self.proposer = proposer

    def draft(self, request: Request, runner_output: ModelRunnerOutput, batch_size: int) -> list[int]:
        return self.proposer.propose(request.all_token_ids, self.num_drafts(request.request_id, batch_size))


class DraftModelDrafter(Drafter):
    def before_step(self, scheduler_output: SchedulerOutput, batch_size: int) -> None:
        if self.policy is not None:
            scheduler_output.num_drafts_to_propose = {
                request_id: self.policy.num_drafts(request_id, batch_size)
                for request_id in scheduler_output.num_scheduled_tokens}

    def draft(self, request: Request, runner_output: ModelRunnerOutput, batch_size: int) -> list[int]:
        return runner_output.draft_token_ids.get(request.request_id, [])
