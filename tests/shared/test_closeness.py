"""The logprob-closeness check: a divergence passes only when it is a near-tie both ways."""

from __future__ import annotations

import pytest

from shared.closeness import first_divergences, logprobs_close


def test_identical_outputs_have_no_divergence():
    ids = [[5, 6, 7], [1]]
    lps = [[{5: -0.1}, {6: -0.2}, {7: -0.3}], [{1: -0.5}]]
    assert first_divergences(ids, lps, ids, lps) == []


def test_a_near_tie_is_close_and_only_the_first_divergence_counts():
    a_ids, b_ids = [[5, 6, 9, 1]], [[5, 8, 2, 3]]
    a_lps = [[{5: -0.1}, {6: -0.6, 8: -0.8}, {9: -0.1}, {1: -0.1}]]
    b_lps = [[{5: -0.1}, {8: -0.6, 6: -0.7}, {2: -0.1}, {3: -0.1}]]  # later tokens unrelated: not compared
    [d] = first_divergences(a_ids, a_lps, b_ids, b_lps)
    assert (d.request, d.position, d.token_a, d.token_b, d.close) == (0, 1, 6, 8, True)
    assert logprobs_close(a_ids, a_lps, b_ids, b_lps)


@pytest.mark.parametrize("missing_in", ["a", "b"])
def test_a_token_missing_from_the_other_top_k_is_not_close(missing_in):
    a_lps = [[{6: -0.1, 8: -3.0}]]
    b_lps = [[{8: -0.1, 6: -3.0}]]
    (a_lps if missing_in == "a" else b_lps)[0][0].pop(8 if missing_in == "a" else 6)
    assert not logprobs_close([[6]], a_lps, [[8]], b_lps)


def test_mismatched_request_counts_are_refused():
    with pytest.raises(ValueError, match="outputs:"):
        first_divergences([[1]], [[{1: 0.0}]], [], [])
