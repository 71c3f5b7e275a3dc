"""Speculative decoding in the periodic stats line: how many drafts were accepted.

The scheduler counts, cumulatively, under vLLM's names (``shared.metrics.SchedulerStats``):
drafts verified (one per request per step that carried any), their tokens, the tokens accepted,
and the tokens accepted at each draft position. ``/metrics`` exports those counters
(``server/metrics.py``); the stats line shows the interval's rates, as vLLM's
``SpecDecodingLogging`` does:

- acceptance rate: accepted draft tokens / draft tokens;
- mean acceptance length: tokens a verifying step gains per request, ``1 + accepted / drafts``
  (the 1 is the token the step samples itself); ``k + 1`` is the most it can be.

vLLM: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``, ``SpecDecodingLogging``,
``SpecDecodingProm``).
"""

from __future__ import annotations

from shared.metrics import SchedulerStats
from stage4_prefix_cache.scheduler import LoggingStatLogger as _PrefixCacheStatLogger


def acceptance(before: SchedulerStats, after: SchedulerStats) -> tuple[float, float] | None:
    """(acceptance rate, mean acceptance length) of the drafts verified between two snapshots; None: none."""
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts <= 0:
        return None
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return accepted / max(draft_tokens, 1), 1 + accepted / drafts


class LoggingStatLogger(_PrefixCacheStatLogger):
    """Stage 4's stats line, plus the drafts' acceptance in the interval when any were verified."""

    @staticmethod
    def fields(before: SchedulerStats, after: SchedulerStats, seconds: float) -> list[str]:
        fields = _PrefixCacheStatLogger.fields(before, after, seconds)
        rates = acceptance(before, after)
        if rates is not None:
            fields.append(f"Spec decode acceptance rate: {100 * rates[0]:.1f}%, "
                          f"mean acceptance length: {rates[1]:.2f}")
        return fields


format_stats_line = LoggingStatLogger.format_line
