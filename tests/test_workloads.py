"""course.workloads: seeded, deterministic, within stated bounds."""

from __future__ import annotations

import statistics

import pytest

from course.workloads import (
    WorkloadRequest,
    random_token_prompts,
    shared_prefix_prompts,
    sharegpt_like_lengths,
    two_phase_load,
)


def test_sharegpt_like_lengths_deterministic_and_seed_sensitive():
    assert sharegpt_like_lengths(50, seed=3) == sharegpt_like_lengths(50, seed=3)
    assert sharegpt_like_lengths(50, seed=3) != sharegpt_like_lengths(50, seed=4)


def test_sharegpt_like_lengths_bounds_and_shape():
    pairs = sharegpt_like_lengths(2000, seed=0, min_len=4, max_prompt_len=1024, max_output_len=1024)
    assert len(pairs) == 2000
    assert all(4 <= p <= 1024 and 4 <= o <= 1024 for p, o in pairs)
    # Stated medians 100 / 200 (log-normal, sigma 1): sample medians land near them.
    assert 85 <= statistics.median(p for p, _ in pairs) <= 115
    assert 170 <= statistics.median(o for _, o in pairs) <= 230


def test_sharegpt_like_lengths_total_cap():
    pairs = sharegpt_like_lengths(500, seed=1, max_total_len=256, min_len=4)
    assert all(p + o <= 256 and p >= 4 and o >= 4 for p, o in pairs)


def test_sharegpt_like_lengths_rejects_bad_args():
    with pytest.raises(ValueError):
        sharegpt_like_lengths(-1)
    with pytest.raises(ValueError):
        sharegpt_like_lengths(3, max_total_len=5, min_len=4)


def test_random_token_prompts():
    prompts = random_token_prompts([5, 0, 17], vocab_size=50, seed=2)
    assert [len(p) for p in prompts] == [5, 0, 17]
    assert all(3 <= t < 50 for p in prompts for t in p)
    assert prompts == random_token_prompts([5, 0, 17], vocab_size=50, seed=2)
    assert prompts != random_token_prompts([5, 0, 17], vocab_size=50, seed=9)


def test_shared_prefix_prompts():
    prompts = shared_prefix_prompts(10, prefix_len=40, vocab_size=100, seed=0, suffix_len=(3, 6))
    assert len(prompts) == 10
    assert all(p[:40] == prompts[0][:40] for p in prompts)
    assert all(3 <= len(p) - 40 <= 6 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 10
    assert prompts == shared_prefix_prompts(10, prefix_len=40, vocab_size=100, seed=0, suffix_len=(3, 6))


def test_two_phase_load_structure():
    load = two_phase_load(512, seed=0)
    assert all(isinstance(r, WorkloadRequest) for r in load)
    phase1 = [r for r in load if r.phase == 1]
    phase2 = [r for r in load if r.phase == 2]
    assert len(phase1) == 12 and all(r.kind == "short" for r in phase1)
    assert load[:12] == phase1  # phase 1 comes first
    assert sum(r.kind == "long" for r in phase2) == 2 and sum(r.kind == "short" for r in phase2) == 8
    system = phase1[0].prompt_token_ids[:384]
    shorts = [r for r in load if r.kind == "short"]
    assert all(r.prompt_token_ids[:384] == system and r.shared_prefix_len == 384 for r in shorts)
    longs = [r for r in load if r.kind == "long"]
    assert all(r.prompt_len == 1024 and r.prompt_token_ids[:384] != system for r in longs)
    assert all(0 <= t < 512 for r in load for t in r.prompt_token_ids)
    assert load == two_phase_load(512, seed=0)
    assert load != two_phase_load(512, seed=1)
