"""Seeded synthetic workloads for the benchmarks, notebooks and tests.

Everything here is a pure function of its arguments and ``seed`` (``random.Random``,
never the global generator), so a benchmark's trace is reproducible from its command line.
Prompts are token ids, so no tokenizer is needed and every stage sees the same tokens.

- ``sharegpt_like_lengths``: (prompt, output) length pairs shaped like the ShareGPT
  conversations used in the PagedAttention paper (mean input ~161, mean output ~338 tokens).
- ``random_token_prompts``: random token ids for given lengths.
- ``shared_prefix_prompts``: one long shared system prefix + short distinct suffixes.
- ``two_phase_load``: the load of the prefix-caching chapter (a burst behind a shared
  system prompt, then two very long prompts among short ones).

Imports no stage.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a synthetic workload."""

    prompt_token_ids: list[int]
    max_tokens: int
    phase: int = 1
    kind: str = "short"  # "short" | "long"
    shared_prefix_len: int = 0  # leading tokens shared with other requests of the workload
    meta: dict = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def sharegpt_like_lengths(n: int, seed: int = 0, *, prompt_median: float = 100.0, prompt_sigma: float = 1.0,
                          output_median: float = 200.0, output_sigma: float = 1.0, min_len: int = 4,
                          max_prompt_len: int = 1024, max_output_len: int = 1024,
                          max_total_len: int | None = None) -> list[tuple[int, int]]:
    """``n`` seeded (prompt_len, output_len) pairs, "ShareGPT-like".

    Distribution: prompt and output lengths are independent log-normals,
    ``round(exp(N(log(median), sigma)))``, with prompt median 100 and output median 200
    tokens and sigma 1.0 for both (means ~165 and ~330, close to ShareGPT's 161 / 338 in the
    PagedAttention paper), clipped to ``[min_len, max_prompt_len]`` and
    ``[min_len, max_output_len]``. With ``max_total_len`` the output is further cut so
    that ``prompt + output <= max_total_len`` (the prompt first to ``max_total_len - min_len``).
    """
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if min_len < 1 or max_prompt_len < min_len or max_output_len < min_len:
        raise ValueError("lengths: need 1 <= min_len <= max_prompt_len and min_len <= max_output_len")
    if max_total_len is not None and max_total_len < 2 * min_len:
        raise ValueError(f"max_total_len: must be >= 2 * min_len, got {max_total_len}")
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        p = _lognormal_int(rng, prompt_median, prompt_sigma, min_len, max_prompt_len)
        o = _lognormal_int(rng, output_median, output_sigma, min_len, max_output_len)
        if max_total_len is not None:
            p = min(p, max_total_len - min_len)
            o = min(o, max_total_len - p)
        pairs.append((p, o))
    return pairs


def random_token_prompts(lengths: list[int], vocab_size: int, seed: int = 0, *,
                         min_token_id: int = 3) -> list[list[int]]:
    """One list of uniform random token ids in ``[min_token_id, vocab_size)`` per length.

    ``min_token_id`` keeps the lowest ids (usually special tokens: pad, bos, eos) out.
    """
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"min_token_id: must be in [0, vocab_size={vocab_size}), got {min_token_id}")
    rng = random.Random(seed)
    return [[rng.randrange(min_token_id, vocab_size) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(num_requests: int, prefix_len: int, vocab_size: int, seed: int = 0, *,
                          suffix_len: int | tuple[int, int] = (8, 32), min_token_id: int = 3) -> list[list[int]]:
    """``num_requests`` prompts = one shared random prefix of ``prefix_len`` tokens + a distinct suffix.

    ``suffix_len`` is a fixed length or an inclusive ``(lo, hi)`` range drawn per request.
    Suffixes are made distinct (their first token differs) so no two prompts are equal.
    """
    lo, hi = (suffix_len, suffix_len) if isinstance(suffix_len, int) else suffix_len
    if lo < 1 or hi < lo:
        raise ValueError(f"suffix_len: need 1 <= lo <= hi, got {suffix_len!r}")
    rng = random.Random(seed)
    prefix = [rng.randrange(min_token_id, vocab_size) for _ in range(prefix_len)]
    span = vocab_size - min_token_id
    prompts = []
    for i in range(num_requests):
        n = rng.randint(lo, hi)
        suffix = [rng.randrange(min_token_id, vocab_size) for _ in range(n)]
        suffix[0] = min_token_id + (i % span)  # distinct heads (for num_requests <= span)
        prompts.append(prefix + suffix)
    return prompts


def two_phase_load(vocab_size: int = 512, seed: int = 0, *, system_prompt_len: int = 384,
                   num_short_phase1: int = 12, num_short_phase2: int = 8, short_suffix_len: tuple[int, int] = (8, 32),
                   num_long: int = 2, long_prompt_len: int = 1024, short_max_tokens: int = 16,
                   long_max_tokens: int = 16, min_token_id: int = 3) -> list[WorkloadRequest]:
    """The prefix-caching chapter's load, phase 1 then phase 2 (in that order).

    Phase 1: a burst of ``num_short_phase1`` short requests, each one long shared system
    prompt (``system_prompt_len`` tokens) + a short distinct user turn.
    Phase 2: ``num_long`` very long prompts (``long_prompt_len`` random tokens each, sharing
    nothing) alongside ``num_short_phase2`` more short requests behind the same system prompt,
    long and short interleaved.
    """
    n_short = num_short_phase1 + num_short_phase2
    shorts = shared_prefix_prompts(n_short, system_prompt_len, vocab_size, seed, suffix_len=short_suffix_len,
                                   min_token_id=min_token_id)
    longs = random_token_prompts([long_prompt_len] * num_long, vocab_size, seed + 1, min_token_id=min_token_id)
    load = [WorkloadRequest(p, short_max_tokens, 1, "short", system_prompt_len) for p in shorts[:num_short_phase1]]
    phase2_short = [WorkloadRequest(p, short_max_tokens, 2, "short", system_prompt_len)
                    for p in shorts[num_short_phase1:]]
    phase2_long = [WorkloadRequest(p, long_max_tokens, 2, "long", 0) for p in longs]
    # Interleave: a long prompt every len(short)/num_long short ones, starting with a long one.
    every = max(1, math.ceil(len(phase2_short) / max(1, num_long)))
    for i, req in enumerate(phase2_short):
        if i % every == 0 and phase2_long:
            load.append(phase2_long.pop(0))
        load.append(req)
    load.extend(phase2_long)
    return load
