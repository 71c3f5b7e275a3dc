"""Speculative decoding: a cheap proposer guesses the next ``k`` tokens, one forward pass of the
model checks them all, and a request gains up to ``k + 1`` tokens per step instead of one.

The pieces, in the order a step meets them:

- ``config/speculative.py``: ``speculative_config`` (vLLM's keys), checked once in ``EngineConfig``;
- ``drafter.py``: what the engine core owns (``make_drafter``): after each step it proposes the next
  drafts of every request that goes on, from ``ngram_proposer.py`` (prompt lookup on the request's
  tokens) or from ``draft_model.py`` (a smaller model with the target's vocabulary and a paged KV cache
  of its own, run on the worker after the target's step);
- ``policy.py``: how many drafts each request proposes, from its recent acceptance and the batch
  size (a draft that will likely be rejected costs a position and gains nothing);
- the scheduler (``core/scheduler.py``) gives a request with drafts ``1 + k`` positions inside the
  one token budget and the KV allocation, and rolls back the positions of rejected drafts;
  ``grammar.py`` keeps drafts inside a structured-output grammar;
- the runner scores every position in one forward pass and calls ``verify.py`` once, which keeps the
  drafts the target model agrees with: ``rejection_sampler.py`` states the rule (and why the output
  keeps the target's distribution);
- ``metrics.py``: acceptance counts under vLLM's names, and the rate in the stats line.

vLLM: ``vllm/v1/spec_decode/`` (``ngram_proposer.py``, ``eagle.py``, ``metrics.py``) and
``vllm/v1/sample/rejection_sampler.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.config import ModelConfig
from shared.named_models import resolve_model
from stage5_server.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from stage5_server.spec_decode.drafter import Drafter, DraftModelDrafter, NgramDrafter
from stage5_server.spec_decode.ngram_proposer import NgramProposer
from stage5_server.spec_decode.policy import DraftPolicy, forward_weights

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig


def make_drafter(config: EngineConfig) -> Drafter | None:
    """The engine core's drafter for an ``EngineConfig``, with the draft-length policy for its device and
    proposer; None: speculation is off."""
    spec = config.speculative
    if spec is None:
        return None
    policy = make_draft_policy(config)
    if spec.method == "ngram":
        return NgramDrafter(NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max), policy)
    return DraftModelDrafter(policy)  # the workers draft, after each step (draft_model.py)


def make_draft_policy(config: EngineConfig) -> DraftPolicy:
    """The draft-length policy for an ``EngineConfig`` with speculation on, for its device and drafter."""
    spec = config.speculative
    draft_cost_ratio = 0.0
    if spec.method == "draft_model":
        draft = ModelConfig.from_pretrained(resolve_model(spec.model))
        draft_cost_ratio = forward_weights(draft) / forward_weights(config.model_config)
    return DraftPolicy.for_device(spec.num_speculative_tokens, config.device.type, draft_cost_ratio)


__all__ = ["SPECULATIVE_METHODS", "DraftModelDrafter", "DraftPolicy", "Drafter", "NgramDrafter", "NgramProposer",
           "SpeculativeConfig", "make_draft_policy", "make_drafter"]
