"""Per-request timelines and the latency numbers derived from them.

TTFT: arrival to first output token. ITL: gaps between consecutive output tokens.
TPOT: (last token - first token) / (output tokens - 1), a per-request mean.
Queue time: arrival to first scheduled. E2E: arrival to finish.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class RequestTimeline:
    arrival: float | None = None
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    finished: float | None = None
    # A server's extra points (time.monotonic, one clock for every process of the machine):
    received: float | None = None  # the HTTP request reached the server
    queued: float | None = None  # the engine core took the request in
    first_delivered: float | None = None  # the first output, detokenized, was handed to its consumer

    @property
    def ttft(self) -> float | None:
        if self.arrival is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """None for a single-token output: there is no inter-token gap to average."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def queue_time(self) -> float | None:
        if self.arrival is None or self.first_scheduled is None:
            return None
        return self.first_scheduled - self.arrival

    @property
    def e2e(self) -> float | None:
        if self.arrival is None or self.finished is None:
            return None
        return self.finished - self.arrival


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of a list of seconds (NaN when empty)."""
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def goodput(num_passed: int, window_seconds: float) -> float:
    """Requests that completed inside the window AND met every SLO, per second of window.

    The denominator is time, never the number of completions: failed and unfinished
    requests cannot vanish from the measurement by not finishing.
    """
    if window_seconds <= 0:
        raise ValueError(f"window_seconds: must be > 0, got {window_seconds!r}")
    if num_passed < 0:
        raise ValueError(f"num_passed: must be >= 0, got {num_passed!r}")
    return num_passed / window_seconds


# Tokens per engine step: vLLM's ``ITERATION_TOKENS_BUCKETS`` (``vllm/v1/metrics/buckets.py``).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class SchedulerStats:
    """A snapshot of an engine core, read by the stats log line and ``/metrics``.

    Counters (``num_preemptions``, ``prefix_cache_*``, ``*_tokens``) are cumulative, and so is
    the histogram of tokens per step (``observe_step``): ``iteration_tokens_counts[i]`` steps
    ran at most ``ITERATION_TOKENS_BUCKETS[i]`` tokens and more than the bucket before (the last
    entry: more than every bucket). A tuple, so a copy of the snapshot shares nothing mutable.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks (or slab slots) in use
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_prompt_tokens_computed: int = 0  # prefill tokens actually run through the model
    num_generation_tokens: int = 0
    num_steps: int = 0
    iteration_tokens_counts: tuple[int, ...] = (0,) * (len(ITERATION_TOKENS_BUCKETS) + 1)
    iteration_tokens_sum: int = 0

    def observe_step(self, num_tokens: int) -> None:
        """One engine step ran ``num_tokens`` tokens (prompt tokens computed plus tokens sampled)."""
        index = bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)
        counts = list(self.iteration_tokens_counts)
        counts[index] += 1
        self.iteration_tokens_counts = tuple(counts)
        self.iteration_tokens_sum += num_tokens
        self.num_steps += 1
