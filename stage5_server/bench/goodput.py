"""Goodput arithmetic: which requests count, and what they are divided by.

Goodput is the number of requests that completed inside the measured window AND met
every SLO, divided by the window's length in seconds (``shared.metrics.goodput``). The
denominator is time. Dividing by completions instead ("offered rate x pass fraction of
the completed ones") lets failed and unfinished requests vanish: see
``completion_only_rate``, kept here only to show how wrong it is.

Every request offered inside the window lands in exactly one bucket:

    offered = completed + failed + outstanding,   passed <= completed

- completed: ended successfully (a finish reason, no error) at or before the window's end;
- failed: ended with an error (HTTP status, error event, timeout, broken stream);
- outstanding: had not ended when the window closed.

ITL policy for requests with no inter-token gap. A request whose output arrived as a
single token (or a single chunk) has no ITL sample and no TPOT: it passes the ITL and
TPOT SLOs *vacuously*, and is held to the TTFT SLO (and completion) alone. The report
counts such requests (``num_no_itl``) so a workload full of them is visible.

Pure functions only: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from shared.metrics import goodput as _goodput
from shared.metrics import percentile

ITL_POLICY = ("a request with fewer than two output tokens (or all tokens in one chunk) has no inter-token gap: "
              "it passes the ITL and TPOT SLOs vacuously and is judged on completion and TTFT alone")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means "not checked"."""

    ttft_ms: float | None = None
    itl_p99_ms: float | None = None  # the p99 of each request's own inter-token gaps
    tpot_ms: float | None = None  # each request's mean time per output token after the first

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_p99_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"slo {name}: must be a positive number of milliseconds, got {value!r}")

    def describe(self) -> str:
        parts = [f"{label} <= {v:g} ms" for label, v in
                 (("TTFT", self.ttft_ms), ("p99 ITL", self.itl_p99_ms), ("TPOT", self.tpot_ms)) if v is not None]
        return ", ".join(parts) or "none (every completion passes)"


@dataclass(frozen=True)
class WindowCounts:
    """Where every request offered inside the window ended up."""

    offered: int
    completed: int
    passed: int
    failed: int
    outstanding: int

    def __post_init__(self) -> None:
        if min(self.offered, self.completed, self.passed, self.failed, self.outstanding) < 0:
            raise ValueError(f"counts: must be >= 0, got {self}")
        if self.passed > self.completed:
            raise ValueError(f"passed: {self.passed} > completed {self.completed}")
        if self.completed + self.failed + self.outstanding != self.offered:
            raise ValueError(f"counts: completed + failed + outstanding = "
                             f"{self.completed + self.failed + self.outstanding} != offered {self.offered}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def tpot_seconds(first_token_time: float | None, last_token_time: float | None, num_output_tokens: int) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens (no gap exists)."""
    if first_token_time is None or last_token_time is None or num_output_tokens < 2:
        return None
    return (last_token_time - first_token_time) / (num_output_tokens - 1)


def meets_slo(ttft_s: float | None, itls_s: list[float], tpot_s: float | None, slo: SLO) -> bool:
    """Does one *completed* request meet every SLO? Seconds in, SLO in milliseconds.

    No ITL samples or no TPOT (one output token): those SLOs pass vacuously (``ITL_POLICY``).
    A completed request without a first token (no TTFT) fails a TTFT SLO.
    """
    if slo.ttft_ms is not None and (ttft_s is None or ttft_s * 1e3 > slo.ttft_ms):
        return False
    if slo.itl_p99_ms is not None and itls_s and percentile(itls_s, 99) * 1e3 > slo.itl_p99_ms:
        return False
    if slo.tpot_ms is not None and tpot_s is not None and tpot_s * 1e3 > slo.tpot_ms:
        return False
    return True


@dataclass(frozen=True)
class Outcome:
    """What the goodput count needs to know about one request (times in seconds, any common origin)."""

    send_time: float
    end_time: float | None  # None: never ended (still running, or cancelled at the window's close)
    ok: bool  # ended with a finish reason and no error
    passed_slo: bool  # meets_slo(...) for a completed request; ignored otherwise


def count_window(outcomes: Iterable[Outcome], window_start: float, window_end: float) -> WindowCounts:
    """Bucket the requests *sent* in ``[window_start, window_end]``; earlier ones (warm-up) are not counted.

    A request that ends after ``window_end`` is outstanding, whatever happened later.
    """
    if window_end < window_start:
        raise ValueError(f"window: end {window_end} is before start {window_start}")
    offered = completed = passed = failed = outstanding = 0
    for o in outcomes:
        if not window_start <= o.send_time <= window_end:
            continue
        offered += 1
        if o.end_time is None or o.end_time > window_end:
            outstanding += 1
        elif not o.ok:
            failed += 1
        else:
            completed += 1
            passed += bool(o.passed_slo)
    return WindowCounts(offered, completed, passed, failed, outstanding)


def goodput_per_second(counts: WindowCounts, window_seconds: float) -> float:
    """Passing completions per second of window (``shared.metrics.goodput``)."""
    return _goodput(counts.passed, window_seconds)


def completion_only_rate(offered: int, completed: int, passed: int, window_seconds: float) -> float:
    """The WRONG estimate: offered rate x (passed / completed). Errors and unfinished requests drop out.

    Kept to show the mistake next to the right number; 0 when nothing completed.
    """
    if window_seconds <= 0:
        raise ValueError(f"window_seconds: must be > 0, got {window_seconds!r}")
    if completed == 0:
        return 0.0
    return (offered / window_seconds) * (passed / completed)


def pass_fraction(counts: WindowCounts) -> float:
    """passed / offered: the pass fraction with every offered request in the denominator (NaN if none)."""
    return counts.passed / counts.offered if counts.offered else math.nan
