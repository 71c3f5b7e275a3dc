"""How a request wants its tokens chosen and when it should stop (mirrors vLLM's SamplingParams).

The fields and their ranges are vLLM's (``vllm/sampling_params.py``); each one is checked here,
and a bad value is a ``ValueError`` that starts with the field's name. What the sampler does
with them, and in which order, is in ``shared/sampler.py``; how a ``StructuredOutputsParams``
constraint is enforced, in ``shared/structured_output.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Below this temperature a request is decoded greedily, as in vLLM (``_SAMPLING_EPS``): dividing
# logits by a temperature of 1e-300 would overflow to inf and make the softmax NaN.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (vLLM's default max_logprobs)


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint, as vLLM's ``SamplingParams.structured_outputs`` takes them.

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object;
    ``regex``: the whole output matches it; ``choice``: the output is one of these strings;
    ``grammar``: an EBNF (GBNF) grammar whose start rule is ``root``, or a Lark grammar.
    JSON is compact by default (``", "`` and ``": "`` between items, no other whitespace):
    a small model allowed "any whitespace" can spend its whole budget on newlines.
    ``any_whitespace=True`` allows it, as vLLM does unless ``disable_any_whitespace``.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json: must be a JSON schema (an object), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object: must be a bool")
        if not isinstance(self.any_whitespace, bool):
            raise ValueError("structured_outputs.any_whitespace: must be a bool")

    @classmethod
    def from_dict(cls, fields: dict) -> StructuredOutputsParams:
        """From a request body's object; an unknown field is a ``ValueError`` naming it."""
        fields = dict(fields)
        if "disable_any_whitespace" in fields:  # vLLM's spelling of the inverse
            disable = fields.pop("disable_any_whitespace")
            if not isinstance(disable, bool):
                raise ValueError("structured_outputs.disable_any_whitespace: must be a bool")
            fields.setdefault("any_whitespace", not disable)
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: unknown field; accepted: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**fields)

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What a built grammar is cached under: the kind and the spec's text. A schema's key
        order stays (properties are generated in that order)."""
        kind = self.kind
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)
        elif kind == "choice":
            spec = json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec, self.any_whitespace


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # how many top alternatives to return beside the sampled token
    n: int = 1  # independent samples of the same prompt (parallel sampling)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # divides (or multiplies, if negative) logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    bad_words: list[str] | None = None  # words the output must never complete
    prompt_logprobs: int | None = None  # top alternatives per prompt token (computed in prefill)
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text)
    detokenize: bool = True  # False: the output's text stays empty, only its token ids are made
    # A grammar the output must follow (``shared/structured_output.py``); a dict is taken as its fields.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            bad("temperature", "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.n > 1 and self.greedy:
            bad("n", "must be 1 for greedy sampling (temperature 0): the n outputs would be identical")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            bad("repetition_penalty", "must be a finite number > 0")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logit_bias is not None and not (
                isinstance(self.logit_bias, dict)
                and all(_is_int(t) and t >= 0 and _is_number(b) and math.isfinite(b)
                        for t, b in self.logit_bias.items())):
            bad("logit_bias", "must map token ids (integers >= 0) to finite numbers")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be non-empty strings")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", "must be a bool")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", "must be a bool")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings need the text: they cannot be used with detokenize=False")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def tokenize_bad_words(bad_words: list[str], encode) -> list[list[int]]:
    """The token sequences ``bad_words`` forbid, as vLLM's ``update_from_tokenizer`` derives them.

    Each word is tokenized as it stands and with a leading space (the same word in the middle of
    a text often tokenizes differently); the spaced form is kept when it is a different sequence
    of the same length. ``encode(text)`` must add no special tokens.
    """
    sequences: list[list[int]] = []
    for word in bad_words:
        plain = encode(word.lstrip())
        if not plain:
            raise ValueError(f"bad_words: {word!r} tokenizes to nothing")
        sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
