"""Speculative decoding: a cheap proposer guesses the next ``k`` tokens, one forward pass of the
model checks them all, and a request gains up to ``k + 1`` tokens per step instead of one.

The pieces, in the order a step meets them:

- ``config.py``: ``speculative_config`` (vLLM's keys), checked once in ``EngineConfig``;
- ``ngram_proposer.py``: prompt lookup, run by the engine core after each step
  (``EngineCore.propose_drafts``) on the tokens the request has;
- ``draft_model.py``: a smaller model with the target's vocabulary and a paged KV cache of its
  own, run on the worker after the target's step; its drafts come back with the step's output;
- the scheduler (``core/scheduler.py``) gives a request with drafts ``1 + k`` positions inside the
  one token budget and the KV allocation, and rolls back the positions of rejected drafts;
- the runner scores every position in one forward pass and keeps the drafts the target model
  agrees with: ``rejection_sampler.py`` states the rule (and why the output keeps the target's
  distribution);
- ``policy.py``: how many drafts each request proposes, from its recent acceptance and the
  batch size (a draft that will likely be rejected costs a position and gains nothing);
- ``metrics.py``: acceptance counts under vLLM's names, and the rate in the stats line.

vLLM: ``vllm/v1/spec_decode/`` (``ngram_proposer.py``, ``eagle.py``, ``metrics.py``) and
``vllm/v1/sample/rejection_sampler.py``.
"""

from __future__ import annotations

from shared.config import ModelConfig
from shared.named_models import resolve_model
from stage5_server.spec_decode.config import SPECULATIVE_METHODS, SpeculativeConfig
from stage5_server.spec_decode.ngram_proposer import NgramProposer
from stage5_server.spec_decode.policy import DraftPolicy, forward_weights
from stage5_server.spec_decode.rejection_sampler import rejection_sample


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    """The engine core's proposer for ``config``; None when speculation is off or the workers propose."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    return None  # draft_model: the workers propose, after each step (draft_model.py)


def make_draft_policy(config) -> DraftPolicy | None:
    """The draft-length policy for an ``EngineConfig`` with speculation on, for its device and drafter;
    None: off."""
    spec = config.speculative
    if spec is None:
        return None
    draft_cost_ratio = 0.0
    if spec.method == "draft_model":
        draft = ModelConfig.from_pretrained(resolve_model(spec.model))
        draft_cost_ratio = forward_weights(draft) / forward_weights(config.model_config)
    return DraftPolicy.for_device(spec.num_speculative_tokens, config.device.type, draft_cost_ratio)


__all__ = ["SPECULATIVE_METHODS", "DraftPolicy", "NgramProposer", "SpeculativeConfig", "make_draft_policy",
           "make_proposer", "rejection_sample"]
