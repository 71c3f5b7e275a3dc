"""The step contract: what the engine core hands every worker once per step, and what comes back.

Stage 4's scheduler hands out live ``Request`` objects: fine in one process, but a tensor-parallel rank
lives in another. So stage 5's scheduler describes each step in plain data that every rank receives
alike, one process or many, and the executor ships it as it is:

- ``scheduled_new_reqs``: a request the workers have not seen, or one that comes back after preemption:
  everything the runner needs to keep it (tokens, block table, sampling parameters, images, adapter);
- ``scheduled_cached_reqs``: the requests the workers already hold: only what each gained since its
  last step (the tokens it sampled, the blocks it was given) and how far its KV now reaches;
- ``num_scheduled_tokens``: positions to compute per request, the cached requests first, then the new
  ones (the order the runner packs them in);
- ``scheduled_spec_decode_tokens``: draft tokens scheduled for verification (their positions are part
  of the request's ``num_scheduled_tokens``); ``num_drafts_to_propose``: with a draft model on the
  workers, how many drafts each request should get for its next step;
- ``finished_req_ids``: requests the workers can forget; ``preempted_req_ids``: requests whose rows
  they can free (each comes back later as a new request);
- ``grammar_bitmask``: the structured-output masks of the requests that sample, computed in the core,
  where the grammars live: one row per position that samples (``1 + len(drafts)`` per request);
- ``kv_connector_metadata``: with a KV connector, the blocks to fill before the forward and to copy or
  send after it (``kv_transfer/``).

The runner answers with a ``ModelRunnerOutput``: a *list* of tokens per request (empty mid-prefill, one
for a decode, several when draft tokens were accepted), the logprobs it was asked for, a draft model's
next drafts, and a pooling runner's vectors.

This module sits beside the rooms, not in any of them: the core (``core/scheduler.py``) writes a
``SchedulerOutput`` and reads a ``ModelRunnerOutput``, the executors carry both, the workers
(``worker/``, ``pooling/``) read the one and write the other, and the drafter (``spec_decode/``) reads
both; it imports nothing of stage 5, so none of them points up into another to reach it.

vLLM: ``ModelRunnerOutput`` in ``vllm/v1/outputs.py``; ``NewRequestData``, ``CachedRequestData`` and
``SchedulerOutput`` in ``vllm/v1/core/sched/output.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.outputs import Logprob
from shared.sampling_params import SamplingParams


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
    mm_features: list = field(default_factory=list)  # the prompt's images (multimodal/inputs.py)
    lora_request: Any = None  # its adapter (lora/); None: the base model


@dataclass
class CachedRequestData:
    """The running requests the workers already hold, one entry per request in each list."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since the workers last saw it
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # the cached requests, then the new ones
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)  # their rows go; their state stays
    grammar_bitmask: torch.Tensor | None = None  # int32 [positions that sample, ceil(vocab / 32)]
    structured_output_request_ids: list[str] = field(default_factory=list)  # the bitmask's requests, in order
    num_drafts_to_propose: dict[str, int] | None = None  # a draft model's: per request; None: k for all
    kv_connector_metadata: Any = None  # the KV connector's part of the step (kv_transfer/); None: no connector

    @property
    def scheduled_req_ids(self) -> list[str]:
        """The scheduled requests in packing order: the cached ones, then the new ones."""
        return self.scheduled_cached_reqs.req_ids + [new.req_id for new in self.scheduled_new_reqs]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # the requests that sampled this step
    sampled_token_ids: list[list[int]]  # per request: the tokens it gained (accepted drafts, then one more)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # one entry per token gained
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # newly scored positions
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # a draft model's next drafts
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)  # a pooling runner's vectors (pooling/)

    @classmethod
    def from_sampled(cls, sampled_token_ids: Mapping[str, list[int]]) -> ModelRunnerOutput:
        """An output of tokens alone (``{request id: tokens}``), as a model-free driver of the scheduler gives."""
        return cls(list(sampled_token_ids), list(sampled_token_ids.values()))

    def by_request(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids))
