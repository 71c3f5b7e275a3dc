"""Are two engines' greedy outputs "close" when they need not be bit-identical (bfloat16)?

Two correct engines in reduced precision round differently, so greedy decoding may take a
different token once two candidates are nearly tied, and the texts diverge from there on.
The check vLLM applies to its models against transformers: walk both token sequences; at
the first position where they differ, each engine's token must be among the other engine's
top-k logprobs at that position (a near-tie, not a wrong model); after that point the
sequences are no longer comparable and are not compared.

vLLM: ``check_logprobs_close`` in ``tests/models/utils.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# One generated sequence: its token ids and, per token, {token id: logprob} of the top k.
TokenLogprobs = Sequence[Mapping[int, float]]


@dataclass(frozen=True)
class Divergence:
    """Where two greedy sequences first differ, and whether the difference is a near-tie."""

    request: int
    position: int
    token_a: int
    token_b: int
    close: bool  # token_a in b's top-k there and token_b in a's


def first_divergences(ids_a: Sequence[Sequence[int]], logprobs_a: Sequence[TokenLogprobs],
                      ids_b: Sequence[Sequence[int]], logprobs_b: Sequence[TokenLogprobs]) -> list[Divergence]:
    """One ``Divergence`` per request whose tokens differ (identical requests give none)."""
    if not len(ids_a) == len(ids_b) == len(logprobs_a) == len(logprobs_b):
        raise ValueError("outputs: both engines must give token ids and logprobs for the same requests")
    found = []
    for i, (a, b) in enumerate(zip(ids_a, ids_b)):
        for pos, (ta, tb) in enumerate(zip(a, b)):
            if ta != tb:
                close = ta in logprobs_b[i][pos] and tb in logprobs_a[i][pos]
                found.append(Divergence(i, pos, ta, tb, close))
                break
        else:
            if len(a) != len(b):  # one stopped early: the shorter one's end is the divergence
                pos = min(len(a), len(b))
                found.append(Divergence(i, pos, a[pos] if pos < len(a) else -1, b[pos] if pos < len(b) else -1,
                                        False))
    return found


def logprobs_close(ids_a, logprobs_a, ids_b, logprobs_b) -> bool:
    """True when every divergence between the two engines' outputs is a near-tie."""
    return all(d.close for d in first_divergences(ids_a, logprobs_a, ids_b, logprobs_b))


def as_token_logprobs(steps) -> list[dict[int, float]]:
    """``RequestOutput.outputs[0].logprobs`` (``{token: Logprob}`` per step) as plain floats."""
    return [{int(t): float(getattr(lp, "logprob", lp)) for t, lp in step.items()} for step in steps]
