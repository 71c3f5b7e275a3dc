"""Prompt lookup: draft the tokens that followed the last n-gram's earlier occurrence.

A request that copies (quotes its prompt, edits a given text, repeats a name or a code line)
often continues the way the same few tokens continued before. So, with no model at all: take
the request's last ``n`` tokens, find where those ``n`` tokens occurred earlier in its own
prompt and output, and propose the (up to) ``k`` tokens that came after that occurrence. The
longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that matches wins (a longer match
is better evidence); among its occurrences, the most recent. No match: no drafts, and the
request decodes one token as usual, at no cost.

Where it runs: in the engine core, right after a step's tokens are appended, from the
``Request``'s own ``all_token_ids``. vLLM runs it on the driver worker from its input batch; here
the core already holds every token, so proposing there costs no extra message, and the drafts are
on the request when the scheduler next counts its budget. A draft model needs its forward pass
and its KV cache, which live on the worker: that proposer belongs there.

vLLM: ``vllm/v1/spec_decode/ngram_proposer.py`` (``NgramProposer``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the configured ``k``) tokens to follow ``token_ids``; [] if no n-gram matches."""
        k = self.k if k is None else k
        num_tokens = len(token_ids)
        if k < 1 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows that end before the last token: an occurrence strictly earlier than the suffix itself,
            # with at least one token after it.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return tokens[follow:follow + k].tolist()
        return []
