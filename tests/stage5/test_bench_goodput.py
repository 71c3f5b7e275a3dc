"""Goodput arithmetic (``stage5_server.bench.goodput``): the denominator is time, and every
offered request lands in exactly one bucket. Pure functions: no server, no model."""

from __future__ import annotations

import pytest

from stage5_server.bench.goodput import (
    SLO,
    Outcome,
    WindowCounts,
    completion_only_rate,
    count_window,
    goodput_per_second,
    meets_slo,
    tpot_seconds,
)

WINDOW_S = 100.0


def test_seed_candidate_a_goodput_is_passing_completions_over_window_not_completion_fraction():
    a = WindowCounts(offered=1000, completed=600, passed=550, failed=400, outstanding=0)
    assert goodput_per_second(a, WINDOW_S) == pytest.approx(5.50)
    # The wrong denominator invents almost four useful requests per second.
    assert completion_only_rate(1000, 600, 550, WINDOW_S) == pytest.approx(9.1667, abs=1e-3)


def test_seed_candidate_b_beats_a_despite_lower_offered_rate():
    a = WindowCounts(1000, 600, 550, 300, 100)
    b = WindowCounts(800, 780, 752, 20, 0)
    assert goodput_per_second(b, WINDOW_S) == pytest.approx(7.52)
    assert completion_only_rate(800, 780, 752, WINDOW_S) == pytest.approx(7.7128, abs=1e-3)
    assert goodput_per_second(b, WINDOW_S) > goodput_per_second(a, WINDOW_S)


def test_no_passing_completion_means_zero_goodput():
    assert goodput_per_second(WindowCounts(10, 0, 0, 10, 0), WINDOW_S) == 0.0
    assert completion_only_rate(10, 0, 0, WINDOW_S) == 0.0


def test_counts_that_lose_a_request_are_rejected():
    with pytest.raises(ValueError, match="offered"):
        WindowCounts(offered=10, completed=6, passed=5, failed=3, outstanding=0)
    with pytest.raises(ValueError, match="passed"):
        WindowCounts(offered=10, completed=5, passed=6, failed=5, outstanding=0)


def test_zero_length_window_is_a_value_error():
    with pytest.raises(ValueError, match="window_seconds"):
        goodput_per_second(WindowCounts(1, 1, 1, 0, 0), 0.0)


def test_count_window_excludes_warmup_and_keeps_failures_and_unfinished_in_offered():
    outcomes = [
        Outcome(send_time=-1.0, end_time=0.5, ok=True, passed_slo=True),  # warm-up: sent before the window
        Outcome(0.0, 1.0, ok=True, passed_slo=True),
        Outcome(0.1, 1.2, ok=True, passed_slo=False),  # completed, missed an SLO
        Outcome(0.2, 0.3, ok=False, passed_slo=False),  # failed (HTTP 400, say)
        Outcome(0.3, None, ok=False, passed_slo=False),  # never ended
        Outcome(0.4, 12.0, ok=True, passed_slo=True),  # ended after the window closed: outstanding
        Outcome(11.0, 11.5, ok=True, passed_slo=True),  # sent after the window: not offered in it
    ]
    counts = count_window(outcomes, window_start=0.0, window_end=10.0)
    assert counts == WindowCounts(offered=5, completed=2, passed=1, failed=1, outstanding=2)
    assert goodput_per_second(counts, 10.0) == pytest.approx(0.1)


def test_single_token_request_passes_itl_and_tpot_slos_vacuously_but_not_ttft():
    slo = SLO(ttft_ms=100, itl_p99_ms=10, tpot_ms=10)
    assert tpot_seconds(1.0, 1.0, num_output_tokens=1) is None
    assert meets_slo(ttft_s=0.05, itls_s=[], tpot_s=None, slo=slo)
    assert not meets_slo(ttft_s=0.5, itls_s=[], tpot_s=None, slo=slo)


def test_slo_uses_each_requests_p99_itl_and_mean_tpot():
    slo = SLO(itl_p99_ms=50)
    assert meets_slo(0.01, [0.01] * 99, 0.01, slo)
    assert not meets_slo(0.01, [0.01] * 98 + [0.2, 0.2], 0.01, slo)  # the tail decides, not the mean
    assert not meets_slo(0.01, [0.01], tpot_s=0.02, slo=SLO(tpot_ms=15))
    assert tpot_seconds(1.0, 1.4, num_output_tokens=5) == pytest.approx(0.1)


def test_no_slo_means_every_completion_passes_and_bad_slo_is_rejected():
    assert meets_slo(None, [], None, SLO())
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO(ttft_ms=0)
