"""The slab's accounting on a hand-made sequence of admissions and releases."""

from __future__ import annotations

import pytest

from stage1_naive import ContiguousKVCache


def test_reservations_are_first_fit_and_merge_on_release():
    slab = ContiguousKVCache(num_slots=100)
    assert slab.reserve("a", 30) == 0
    assert slab.reserve("b", 30) == 30
    assert slab.reserve("c", 30) == 60
    assert slab.reserve("d", 30) is None  # 10 slots left
    slab.release("b")
    assert slab.reserve("d", 20) == 30  # first fit reuses the hole
    slab.release("a")
    slab.release("d")
    assert [(e.start, e.length) for e in slab.free_extents] == [(0, 60), (90, 10)]


def test_reserve_takes_the_first_hole_that_fits_and_a_refusal_changes_nothing():
    slab = ContiguousKVCache(num_slots=100)
    assert [slab.reserve(name, 30) for name in "abc"] == [0, 30, 60]
    assert [(e.start, e.length) for e in slab.free_extents] == [(90, 10)]
    assert slab.reserve("d", 11) is None  # 10 slots left: refused
    assert [(e.start, e.length) for e in slab.free_extents] == [(90, 10)] and "d" not in slab.reservations
    assert slab.reserve("d", 10) == 90  # an exact fit uses the extent up
    assert slab.free_extents == [] and slab.free_slots == 0
    assert slab.reservations["b"].start == 30 and slab.reservations["b"].length == 30


def test_release_merges_a_hole_with_free_neighbours_on_both_sides():
    slab = ContiguousKVCache(num_slots=100)
    for name in "abcd":
        slab.reserve(name, 25)
    slab.release("a")
    slab.release("c")
    assert [(e.start, e.length) for e in slab.free_extents] == [(0, 25), (50, 25)]
    slab.release("b")  # touches both holes: one extent of 75
    assert [(e.start, e.length) for e in slab.free_extents] == [(0, 75)]
    assert slab.reserve("e", 75) == 0
    assert "b" not in slab.reservations and "b" not in slab.written


def test_internal_fragmentation_is_reserved_minus_written():
    slab = ContiguousKVCache(num_slots=100)
    slab.reserve("a", 40)
    slab.reserve("b", 40)
    slab.mark_written("a", 10)
    slab.mark_written("b", 35)
    assert slab.reserved_slots == 80 and slab.used_slots == 45
    assert slab.internal_fragmentation == 35


def test_external_fragmentation_counts_free_holes_too_small_for_a_reservation():
    slab = ContiguousKVCache(num_slots=100)
    for name in "abcde":
        slab.reserve(name, 20)
    slab.release("b")
    slab.release("d")
    # 40 slots are free, in two holes of 20: a 30-slot reservation fits in neither.
    assert slab.free_slots == 40
    assert slab.external_fragmentation(30) == 40
    assert slab.external_fragmentation(20) == 0
    assert not slab.can_reserve(30)


def test_double_reservation_is_rejected():
    slab = ContiguousKVCache(num_slots=10)
    slab.reserve("a", 5)
    with pytest.raises(ValueError, match="request_id"):
        slab.reserve("a", 5)


def test_static_batch_holds_reservations_until_its_slowest_member_ends(tiny_llama):
    from shared import SamplingParams
    from stage1_naive import LLM

    llm = LLM(model=str(tiny_llama), max_model_len=64, max_num_seqs=2, num_kv_slots=64 * 3)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for prompt, params in [("a", short), ("b", long), ("c", short)]:
        llm.add_request(prompt, params)
    engine = llm.engine
    llm.step()
    assert [r.request_id for r in engine.batch] == ["0", "1"] and len(engine.waiting) == 1
    llm.step()  # request 0 is done, but its reservation stays and "2" still waits
    assert engine.batch[0].is_finished and engine.kv_cache.reserved_slots == 128
    assert len(engine.waiting) == 1
    while engine.batch:
        llm.step()
    llm.step()
    assert [r.request_id for r in engine.batch] == ["2"]


def test_engine_rejects_a_slab_smaller_than_one_reservation(tiny_llama):
    from stage1_naive import LLM

    with pytest.raises(ValueError, match="num_kv_slots"):
        LLM(model=str(tiny_llama), max_model_len=128, num_kv_slots=100)


def test_stage1_has_no_block_size(tiny_llama):
    from stage1_naive import LLM

    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(tiny_llama), block_size=16)
