"""Speculative decoding's counters, and what the stats line says of them.

The scheduler counts, cumulatively and under vLLM's names, the drafts verified (one per request
per step that carried any), their tokens, the tokens accepted, and the tokens accepted at each draft
position. They ride in the engine core's stats (``core/stats.py``); ``/metrics`` exports them as
``vllm:spec_decode_*`` (``server/metrics.py``) and the stats line shows the interval's rates, as
vLLM's ``SpecDecodingLogging`` does:

- acceptance rate: accepted draft tokens / draft tokens;
- mean acceptance length: tokens a verifying step gains per request, ``1 + accepted / drafts``
  (the 1 is the token the step samples itself); ``k + 1`` is the most it can be.

vLLM: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``, ``SpecDecodingLogging``,
``SpecDecodingProm``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodingStats:
    """Cumulative counts; ``num_accepted_tokens_per_pos[i]``: drafts whose token i was accepted. Frozen: a
    stats snapshot shares it safely."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    def observe(self, num_draft_tokens: int, num_accepted: int) -> SpecDecodingStats:
        """These counts after one request verified ``num_draft_tokens`` drafts and kept the first ``num_accepted``."""
        per_pos = list(self.num_accepted_tokens_per_pos)
        per_pos += [0] * (num_draft_tokens - len(per_pos))
        for position in range(num_accepted):
            per_pos[position] += 1
        return SpecDecodingStats(self.num_drafts + 1, self.num_draft_tokens + num_draft_tokens,
                                 self.num_accepted_tokens + num_accepted, tuple(per_pos))

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Two engine cores' counts together (position by position)."""
        mine, theirs = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        width = max(len(mine), len(theirs))
        per_pos = tuple(a + b for a, b in zip(mine + (0,) * (width - len(mine)), theirs + (0,) * (width - len(theirs))))
        return SpecDecodingStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                                 self.num_accepted_tokens + other.num_accepted_tokens, per_pos)

    def acceptance(self, before: SpecDecodingStats) -> tuple[float, float] | None:
        """(acceptance rate, mean acceptance length) of the drafts verified since ``before``; None: none."""
        drafts = self.num_drafts - before.num_drafts
        if drafts <= 0:
            return None
        accepted = self.num_accepted_tokens - before.num_accepted_tokens
        return accepted / max(self.num_draft_tokens - before.num_draft_tokens, 1), 1 + accepted / drafts

    def log_fields(self, before: SpecDecodingStats) -> list[str]:
        """The stats line's part: the interval's acceptance, when any drafts were verified."""
        rates = self.acceptance(before)
        if rates is None:
            return []
        return [f"Spec decode acceptance rate: {100 * rates[0]:.1f}%, mean acceptance length: {rates[1]:.2f}"]
