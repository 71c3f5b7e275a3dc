"""How a request wants its tokens chosen and when it should stop (mirrors vLLM's SamplingParams)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature a request is decoded greedily, as in vLLM (``_SAMPLING_EPS``): dividing
# logits by a temperature of 1e-300 would overflow to inf and make the softmax NaN.
SAMPLING_EPS = 1e-5


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
