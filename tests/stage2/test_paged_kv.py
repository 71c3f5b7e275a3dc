"""Blocks, block tables and the torch paged-attention reference."""

from __future__ import annotations

import pytest
import torch

from shared.attention import causal_attention
from stage2_paged import (
    BlockAllocator,
    BlockTable,
    OutOfBlocksError,
    build_paged_metadata,
    gather_kv,
    paged_attention,
    slot_mapping,
)


def test_allocating_from_an_empty_pool_raises_and_changes_nothing():
    allocator = BlockAllocator(3)
    taken = allocator.allocate(2)
    with pytest.raises(OutOfBlocksError, match="2 KV blocks, 1 free"):
        allocator.allocate(2)
    assert allocator.num_free == 1
    allocator.free(taken)
    assert allocator.num_free == 3


def test_seed_example_a_to_h_occupies_two_blocks_that_need_not_be_adjacent():
    # Block size 4; letters stand for token ids. Other requests already hold some blocks.
    allocator = BlockAllocator(8, shuffle_seed=3)
    other = allocator.allocate(1)
    table = BlockTable(block_size=4)
    a_to_h = list(range(8))
    table.grow(4, allocator)  # A B C D
    allocator.allocate(1)  # someone else grows in between
    table.grow(len(a_to_h), allocator)  # E F G H
    assert len(table.block_ids) == 2
    assert table.block_ids[1] != table.block_ids[0] + 1  # not adjacent, and nothing cares
    assert other[0] not in table.block_ids
    # Logical block 0 holds positions 0-3, logical block 1 positions 4-7, at whatever ids were free.
    assert table.slot_mapping(0, 8) == [table.block_ids[p // 4] * 4 + p % 4 for p in range(8)]


def test_block_table_grows_only_when_a_block_fills():
    allocator = BlockAllocator(10)
    table = BlockTable(block_size=4)
    assert len(table.grow(1, allocator)) == 1
    assert table.grow(4, allocator) == []
    assert len(table.grow(5, allocator)) == 1
    assert allocator.num_free == 8


def test_blocks_needed_counts_only_the_blocks_the_table_lacks():
    table = BlockTable(block_size=4)
    assert [table.blocks_needed(n) for n in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]
    table.block_ids = [7, 3]  # covers 8 tokens
    assert [table.blocks_needed(n) for n in (1, 8, 9, 13)] == [0, 0, 1, 2]


def test_slot_mapping_follows_the_table_across_scattered_blocks():
    r1 = [12, 41, 90]  # the course's figure: R1's A B C D | E F X Y | Z
    assert slot_mapping(r1, 4, 0, 9) == [48, 49, 50, 51, 164, 165, 166, 167, 360]
    assert slot_mapping(r1, 4, 2, 6) == [50, 51, 164, 165] and slot_mapping(r1, 4, 5, 5) == []
    table = BlockTable(block_size=4)
    table.block_ids = list(r1)
    assert table.slot_mapping(2, 6) == [50, 51, 164, 165]
    assert slot_mapping([3, 0], 8, 6, 10) == [30, 31, 0, 1]  # another block size


def test_gather_kv_returns_positions_in_logical_order():
    block_size, num_blocks = 4, 6
    # Each slot holds its own flat index, so the gathered rows name the slots they came from.
    cache = torch.arange(num_blocks * block_size, dtype=torch.float32).reshape(num_blocks, block_size, 1, 1)
    table = torch.tensor([5, 2, 0, 0], dtype=torch.int32)  # two real blocks, then padding
    rows = gather_kv(cache, table, 6)
    assert rows.shape == (6, 1, 1)
    assert rows.flatten().tolist() == [20, 21, 22, 23, 8, 9]


def _random_paged_batch(block_size, num_kv_heads, group, head_dim, seq_lens, query_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    allocator = BlockAllocator(128, shuffle_seed=seed)
    key_cache = torch.randn(128, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(128, block_size, num_kv_heads, head_dim, generator=gen)
    tables = []
    for n in seq_lens:
        t = BlockTable(block_size)
        t.grow(n, allocator)
        tables.append(t.block_ids)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], num_heads, head_dim, generator=gen)
    meta = build_paged_metadata([0] * qsl[-1], qsl, list(seq_lens), tables, "cpu")
    return query, key_cache, value_cache, tables, meta


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_attention_equals_dense_attention_on_gathered_keys(block_size, group):
    seq_lens, query_lens = [1, 17, 40, 5, 33], [1, 17, 1, 3, 8]  # decode, prefill, chunk after a prefix
    query, kc, vc, tables, meta = _random_paged_batch(block_size, 2, group, 32, seq_lens, query_lens)
    out = paged_attention(query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2)
    qsl = meta.query_start_loc.tolist()
    for i, n in enumerate(seq_lens):
        slots = [tables[i][p // block_size] * block_size + p % block_size for p in range(n)]
        keys = kc.flatten(0, 1)[slots]
        values = vc.flatten(0, 1)[slots]
        want = causal_attention(query[qsl[i]:qsl[i + 1]], keys, values, 0.2)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], want, rtol=1e-5, atol=1e-5)


def test_stage2_admits_by_blocks_where_stage1_reserves_max_model_len(tiny_llama):
    from shared import SamplingParams
    from stage1_naive import LLM as NaiveLLM
    from stage2_paged import LLM as PagedLLM

    budget = 4 * 128  # tokens of KV for both
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    naive = NaiveLLM(model=str(tiny_llama), max_model_len=128, max_num_seqs=16, num_kv_slots=budget)
    paged = PagedLLM(model=str(tiny_llama), max_model_len=128, max_num_seqs=16, block_size=16,
                     num_kv_blocks=budget // 16)
    for llm in (naive, paged):
        for i in range(16):
            llm.add_request(f"request {i}", params)
        llm.step()
    assert len(naive.engine.batch) == 4  # 512 slots / 128-slot reservations
    assert len(paged.engine.batch) == 16  # each needs ~1 block of 16 tokens
