"""What crosses from the engine core to every worker and back, once per step.

The scheduler's ``SchedulerOutput`` holds live ``Request`` objects: fine in one process, but a
tensor-parallel rank lives in another. So the core distills each step into a ``ModelRunnerInput``
of plain data that every rank receives alike, one process or many:

- ``new_reqs``: a request the workers have not seen, or one that comes back after preemption:
  everything the runner needs to keep it (tokens, block table, sampling parameters);
- ``cached_reqs``: a request the workers already hold: only what it gained since its last step
  (the tokens it sampled, the blocks it was given) and how far its KV now reaches;
- ``spec_token_ids``: draft tokens scheduled for verification (their positions are part of the
  request's ``num_scheduled_tokens``);
- ``num_drafts_to_propose``: with a draft model on the workers, how many drafts each request
  should get for its next step (the draft-length policy's answer; absent: ``k``);
- ``finished_req_ids``: requests the workers can forget; ``preempted_req_ids``: requests whose rows
  they can free (each comes back later as a new request);
- ``grammar_bitmask``: the structured-output masks of each request that samples, computed in the
  core, where the grammars live: one per position that samples (``1 + len(drafts)`` rows).

The runner answers with a ``ModelRunnerOutput``: a *list* of tokens per request (empty mid-prefill,
one for a decode, several when draft tokens were accepted), the logprobs it was asked for, and
with a draft model the drafts it proposes for each request's next step.

vLLM: ``NewRequestData``, ``CachedRequestData`` and ``SchedulerOutput`` in
``vllm/v1/core/sched/output.py`` (there the scheduler ships these itself); ``ModelRunnerOutput``
in ``vllm/v1/outputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.outputs import Logprob
from shared.sampling_params import SamplingParams
from stage5_server.lora.request import LoRARequest
from stage5_server.multimodal.inputs import MultiModalFeature


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    bad_words_token_ids: list[list[int]]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_logprobs_done: int  # prompt positions already scored (a resumed request keeps them)
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # the prompt's images
    lora_request: LoRARequest | None = None  # its adapter (lora/); None: the base model


@dataclass
class CachedRequestData:
    """The running requests the workers already hold, one entry per request in each list."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since the workers last saw it
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class ModelRunnerInput:
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: list[int]  # per request, in the order ``scheduled_req_ids``
    scheduled_req_ids: list[str]  # ``cached_reqs`` then ``new_reqs``, in their order (stage 3's packing order)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)  # their rows go; their state stays
    grammar_bitmask: torch.Tensor | None = None  # int32 [positions that sample, ceil(vocab / 32)]
    grammar_req_ids: list[str] = field(default_factory=list)
    num_drafts_to_propose: dict[str, int] | None = None  # a draft model's: per request, None: k for all


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # the requests that sampled this step
    sampled_token_ids: list[list[int]]  # per request: the tokens it gained (accepted drafts, then one more)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # one entry per token gained
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # newly scored positions
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # a draft model's next drafts
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)  # a pooling runner's vectors (pooling/)

    def by_request(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids))
