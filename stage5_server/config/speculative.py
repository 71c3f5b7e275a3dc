"""``speculative_config``: which proposer drafts tokens, and how many, checked once.

``LLM(speculative_config={...})`` and ``stagedserve serve --speculative-config '{...}'`` take
vLLM's keys:

- ``method``: ``"ngram"`` (prompt lookup, no model) or ``"draft_model"`` (a smaller model with
  the target's vocabulary); left out, it is ``draft_model`` when a ``model`` is given;
- ``num_speculative_tokens``: ``k``, the most draft tokens a request verifies per step (>= 1);
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram): the n-gram lengths tried, longest
  first; one given sets the other, neither gives vLLM's 5 and 5;
- ``model`` (draft_model): the draft checkpoint (a directory, a ``.gguf`` file or a name).

A bad value is a ``ValueError`` naming the key, before anything loads (on the command line, an
argparse error before any engine process starts: ``speculative_config_arg``); so is a draft model whose
vocabulary is not the target's, or a draft model with a split target (its drafts would need the
target's ranks to agree on them).

vLLM: ``SpeculativeConfig`` in ``vllm/config/speculative.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.config import ModelConfig
from shared.named_models import resolve_model
from stage5_server.arg_types import checked_json_object, json_object_argument

SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None  # the draft checkpoint (draft_model)

    @classmethod
    def create(cls, value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """``value`` as ``LLM`` or the command line gives it: a dict, its JSON text, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object_argument("speculative_config", value, SPECULATIVE_KEYS)
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method: must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {value.get('method')!r}")
        k = value.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}")
        model = value.get("model")
        if method == "draft_model" and not (isinstance(model, str) and model):
            raise ValueError("speculative_config.model: draft_model needs the draft checkpoint's path")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model: ngram uses no model")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if method != "ngram" and (low is not None or high is not None):
            raise ValueError("speculative_config.prompt_lookup_min/max: only for ngram")
        low, high = (DEFAULT_PROMPT_LOOKUP,) * 2 if low is None and high is None else \
            (high if low is None else low, low if high is None else high)
        for name, bound in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not _is_int(bound) or bound < 1:
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1, got {bound!r}")
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min: {low} is more than prompt_lookup_max {high}")
        return cls(method, k, low, high, model)


# ``--speculative-config``: its keys are checked as the command line is read (the draft checkpoint itself is
# read later, ``check_draft_model``)
speculative_config_arg = checked_json_object(SpeculativeConfig.create)


def check_draft_model(spec: SpeculativeConfig | None, target: ModelConfig, tensor_parallel_size: int) -> None:
    """A draft model must share the target's vocabulary, and the target must run on one rank."""
    if spec is None or spec.method != "draft_model":
        return
    if tensor_parallel_size > 1:
        raise ValueError("speculative_config.model: a draft model needs tensor_parallel_size 1 "
                         f"(got {tensor_parallel_size})")
    draft = ModelConfig.from_pretrained(resolve_model(spec.model))
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} tokens, "
                         f"the target's {target.vocab_size}; they must be the same")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
