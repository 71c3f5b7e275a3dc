"""The CPU attention backend agrees with the torch reference (stage2's ``paged_attention``).

Ragged batches with blocks scattered through a shuffled pool (garbage in the unused ones):
decodes only, prefills only, prefill chunks over cached context, and all of them mixed; MHA
and GQA; float32 to 1e-5 and bfloat16 to the Triton tests' 2e-2; the decodes both ways, by the C++
operator reading the blocks in place (built here as in ``make``'s set-up) and by SDPA over gathered
blocks, the path taken where the operator cannot be built.
"""

from __future__ import annotations

import pytest
import torch

from stage2_paged.attention import PagedAttentionBackend, paged_attention
from stage2_paged.kv_cache import PagedKVCache
from stage5_server.attention.cpu_attn import CPUAttentionBackend, grouped_paged_attention, plan_groups
from stage5_server.cpu_kernels.paged_decode import load_cpu_kernels

IN_PLACE = [False, pytest.param(True, marks=pytest.mark.skipif(
    load_cpu_kernels() is not None, reason=f"the C++ decode operator did not build: {load_cpu_kernels()}"))]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

BATCHES = {
    "decodes": ([1, 17, 70, 33, 5], [1, 1, 1, 1, 1]),
    "prefills": ([9, 40, 23], [9, 40, 23]),
    "chunks_over_context": ([50, 31, 64], [12, 31, 3]),
    "mixed": ([1, 90, 17, 41, 8, 26], [1, 1, 17, 5, 1, 26]),
}


def make_paged_batch(seq_lens, q_lens, *, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Random caches and queries; each sequence's blocks come from a shuffled pool, tables padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), query_start_loc


def _metadata(block_tables, seq_lens, query_start_loc, q_lens):
    from stage2_paged.attention import PagedAttentionMetadata

    return PagedAttentionMetadata(slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
                                  query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
                                  max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()))


@pytest.mark.parametrize("in_place_decodes", IN_PLACE)
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype", [
    (16, 4, 4, 32, torch.float32),
    (8, 9, 3, 64, torch.float32),  # SmolLM2's GQA ratio
    (16, 8, 2, 32, torch.bfloat16),
])
def test_grouped_attention_matches_reference(batch, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                             in_place_decodes):
    seq_lens, q_lens = BATCHES[batch]
    query, key_cache, value_cache, tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, q_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype)
    expected = paged_attention(query, key_cache, value_cache, tables, seq_lens_t, qsl, 0.3)
    plan = plan_groups(_metadata(tables, seq_lens_t, qsl, q_lens), block_size, num_heads // num_kv_heads, dtype,
                       in_place_decodes)
    assert len(plan) == len({n == 1 for n in q_lens})  # one call for the decodes, one for the rest
    actual = grouped_paged_attention(query, key_cache, value_cache, plan, 0.3)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("in_place_decodes", IN_PLACE)
def test_backend_writes_the_same_cache_and_output_as_the_reference_backend_over_layers_and_steps(in_place_decodes):
    """Two layers, two steps: the plan made by a step's first layer must not leak into the next step."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 8
    caches = [PagedKVCache(12, block_size, 2, num_kv_heads, head_dim) for _ in range(2)]
    backends = [PagedAttentionBackend(caches[0]), CPUAttentionBackend(caches[1], in_place_decodes)]
    from stage2_paged.attention import build_paged_metadata

    tables = [[5, 2, 9], [7, 0]]
    steps = [  # (seq_lens after the step, new tokens per sequence): a prefill step, then a decode step
        ([19, 11], [19, 11]),
        ([20, 12], [1, 1]),
    ]
    for seq_lens, q_lens in steps:
        slots, qsl = [], [0]
        for table, end, n in zip(tables, seq_lens, q_lens):
            slots += [table[p // block_size] * block_size + p % block_size for p in range(end - n, end)]
            qsl.append(qsl[-1] + n)
        meta = build_paged_metadata(slots, qsl, seq_lens, tables, "cpu")
        for layer in range(2):
            q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen)
            k, v = (torch.randn(qsl[-1], num_kv_heads, head_dim, generator=gen) for _ in range(2))
            expected, actual = (b.forward(layer, q, k, v, meta, 0.2) for b in backends)
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    for layer in range(2):
        torch.testing.assert_close(caches[1].key[layer], caches[0].key[layer], atol=0, rtol=0)
        torch.testing.assert_close(caches[1].value[layer], caches[0].value[layer], atol=0, rtol=0)


@pytest.mark.skipif(load_cpu_kernels() is not None, reason="the C++ decode operator did not build")
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("seq_lens", [[700], [1000, 3], [64, 65, 129]])
def test_fewer_sequences_than_threads_split_their_blocks_into_parts_and_merge_exactly(seq_lens, threads):
    """One KV head and few sequences: each sequence's blocks run as parts on the threads (split-K)."""
    from stage5_server.cpu_kernels.paged_decode import cpu_paged_decode_attention

    query, key_cache, value_cache, tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, [1] * len(seq_lens), block_size=16, num_heads=3, num_kv_heads=1, head_dim=64,
        dtype=torch.float32)
    expected = paged_attention(query, key_cache, value_cache, tables, seq_lens_t, qsl, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full_like(query, float("nan"))
        rows = torch.arange(len(seq_lens))
        cpu_paged_decode_attention(out, query, key_cache, value_cache, tables, seq_lens_t, rows, rows, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(load_cpu_kernels() is not None, reason="the C++ decode operator did not build")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("head_dim", [24, 32, 64, 128, 256])  # vector widths compiled for 32, 64, 128
@pytest.mark.parametrize("group", [1, 3, 6, 7])  # query heads per KV head: whole and partial sets of registers
def test_the_decode_operator_matches_the_reference_for_each_head_size_and_group(head_dim, group, dtype, tolerance):
    """Each head size takes its own code (a compiled vector width, or scalar loops for the others) and
    each group size its own split into sets of query heads; all of them give the reference's result."""
    from stage5_server.cpu_kernels.paged_decode import cpu_paged_decode_attention

    seq_lens, q_lens = BATCHES["decodes"]
    query, key_cache, value_cache, tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, q_lens, block_size=16, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    expected = paged_attention(query.float(), key_cache.float(), value_cache.float(), tables, seq_lens_t, qsl, 0.2)
    out = torch.full_like(query, float("nan"))
    rows = torch.arange(len(seq_lens))
    cpu_paged_decode_attention(out, query, key_cache, value_cache, tables, seq_lens_t, rows, rows, 0.2)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(load_cpu_kernels() is not None, reason="the C++ decode operator did not build")
def test_the_decode_operator_reads_strided_queries_and_rejects_mismatched_inputs():
    """The model's queries are a view into the fused QKV projection: every row strided, as here."""
    from stage5_server.cpu_kernels.paged_decode import cpu_paged_decode_attention

    seq_lens, q_lens = BATCHES["decodes"]
    query, key_cache, value_cache, tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, q_lens, block_size=8, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    fused = torch.cat([query, torch.randn_like(query)], dim=-1)  # [T, H, 2D]: the query is its first half
    strided = fused[..., :64]
    assert not strided.is_contiguous()
    expected = paged_attention(query, key_cache, value_cache, tables, seq_lens_t, qsl, 0.3)
    out = torch.full_like(query, float("nan"))
    rows = torch.arange(len(seq_lens))
    cpu_paged_decode_attention(out, strided, key_cache, value_cache, tables, seq_lens_t, rows, rows, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_paged_decode_attention(out, strided.double(), key_cache, value_cache, tables, seq_lens_t, rows, rows, 0.3)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_paged_decode_attention(out, strided, key_cache, value_cache, tables.long(), seq_lens_t, rows, rows, 0.3)


def test_without_a_compiler_the_decodes_take_the_sdpa_path(tmp_path):
    """A machine that cannot build the operator (here: no such compiler) gets the reason and SDPA."""
    import os
    import subprocess
    import sys

    code = ("from stage5_server.cpu_kernels.paged_decode import load_cpu_kernels\n"
            "from stage2_paged.kv_cache import PagedKVCache\n"
            "from stage5_server.attention.cpu_attn import CPUAttentionBackend\n"
            "print(load_cpu_kernels())\n"
            "print(CPUAttentionBackend(PagedKVCache(4, 8, 1, 2, 16)).in_place_decodes)\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "STAGEDSERVE_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    reason, in_place = run.stdout.strip().splitlines()
    assert reason.startswith("the C++ CPU operators did not build"), reason
    assert in_place == "False"


@pytest.mark.skipif(load_cpu_kernels() is not None, reason="the C++ decode operator did not build")
def test_the_decode_attention_benchmark_times_two_paths_that_agree():
    """benchmarks.cpu_decode_attention times the operator against the SDPA path on the same steps; both give the
    same attention for each of its sequence sets, and its floor counts the bytes the sequences hold."""
    from benchmarks.cpu_decode_attention import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, decode_sets, measure

    key_cache, value_cache, query, steps, lens = decode_sets(4, torch.float32)
    for meta in steps[:2]:
        in_place, sdpa = (grouped_paged_attention(query, key_cache, value_cache,
                                                  plan_groups(meta, BLOCK_SIZE, HEADS // KV_HEADS, torch.float32, p),
                                                  HEAD_DIM ** -0.5) for p in (True, False))
        torch.testing.assert_close(in_place, sdpa, atol=1e-5, rtol=1e-5)
    row = measure(4, torch.float32, bandwidth=1e9, calls=2)
    expected_floor = sum(int(n.sum()) for n in lens) / len(lens) * KV_HEADS * HEAD_DIM * 2 * 4 / 1e9 * 1e3
    assert row["floor_ms"] == pytest.approx(expected_floor)
    assert row["operator_ms"] > 0 and row["sdpa_ms"] > 0
