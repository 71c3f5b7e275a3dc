"""Draft tokens under a structured-output grammar.

A grammar forbids tokens; a draft it forbids can never be accepted, so neither it nor any draft
after it is worth a position (``num_valid_drafts``). The drafts that remain are verified in one
forward pass, each position sampling under its own mask: the tokens the grammar allows after the
outputs and the drafts before that position (``fill_bitmask_with_drafts``). The matcher follows
the drafts to compute those masks and is rolled back after: drafts are not outputs until accepted.

vLLM: ``validate_tokens`` in ``vllm/v1/structured_output/request.py`` and the spec-decode branch of
``StructuredOutputManager.grammar_bitmask`` in ``vllm/v1/structured_output/__init__.py``.
"""

from __future__ import annotations

import torch

from shared.structured_output import StructuredOutputRequest


def num_valid_drafts(grammar: StructuredOutputRequest, output_token_ids: list[int],
                     draft_token_ids: list[int]) -> int:
    """How many of ``draft_token_ids``, in a row, the grammar allows after the outputs."""
    matcher = grammar.sync(output_token_ids)
    return 0 if matcher.is_error() or matcher.is_stopped() else matcher.validate_tokens(draft_token_ids)


def fill_bitmask_with_drafts(grammar: StructuredOutputRequest, bitmask: torch.Tensor, row: int,
                             output_token_ids: list[int], draft_token_ids: list[int]) -> None:
    """Row ``row + i``: the tokens allowed after the outputs and the first ``i`` drafts, one mask per
    position that samples (the rows past a draft the grammar forbids stay open: sampling never gets there)."""
    matcher = grammar.sync(output_token_ids)
    if not draft_token_ids or matcher.is_error():
        grammar.fill_bitmask(bitmask, row, output_token_ids)
        return
    valid = matcher.validate_tokens(list(draft_token_ids))
    consumed = 0
    for i in range(valid + 1):
        row_view = bitmask[row + i]
        matcher.unsafe_compute_mask_ptr(row_view.data_ptr(), row_view.numel() * row_view.element_size())
        if i == valid or matcher.is_stopped():
            break
        matcher.consume_token(draft_token_ids[i])  # allowed: validate_tokens said so
        consumed += 1
    if consumed:
        matcher.rollback(consumed)  # back to the outputs: the drafts are not outputs yet
