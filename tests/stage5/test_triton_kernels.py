"""The Triton kernels agree with the torch reference (stage2's ``paged_attention``).

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below
before the kernels are imported), so shapes are kept small. Every output buffer is filled
with NaN first: an element a kernel forgets to write fails the comparison.

Tolerances (max abs and rel error against the fp32-softmax reference):
float32 1e-4 (the kernels use IEEE fp32 dots, no TF32); float16 5e-3 (the probabilities
are rounded to fp16 before the P @ V product, as in every flash-attention kernel).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from stage2_paged.attention import paged_attention  # noqa: E402
from stage5_server.kernels import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
    triton_paged_attention,
)
from stage5_server.kernels import paged_attention as kernels_module  # noqa: E402
from stage5_server.kernels.reshape_and_cache import INTERPRET  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("stage5_server.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels "
                "are compiled for a GPU; set TRITON_INTERPRET=1 before anything imports stage5_server",
                allow_module_level=True)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    assert not actual.isnan().any(), "kernel left elements unwritten (NaN poison survived)"
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def make_paged_batch(seq_lens, q_lens, *, block_size, num_heads, num_kv_heads, head_dim, dtype,
                     seed=0, spare_blocks=5, strided=False):
    """Random caches, queries and scattered block tables for a ragged batch.

    Every sequence gets its blocks from a random permutation of the pool (so they are shuffled
    and non-adjacent), unused blocks hold random garbage, and table rows are padded with 0.
    ``strided`` makes the query and the block table non-contiguous views.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)

    pool = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2  # padding columns, like a runner that over-allocates
    table_storage = torch.zeros(len(seq_lens), max_blocks + (3 if strided else 0), dtype=torch.int32)
    block_tables = table_storage[:, :max_blocks]
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)

    num_tokens = sum(q_lens)
    if strided:  # query as a slice of a packed [T, 3, H, D] projection
        query = torch.randn(num_tokens, 3, num_heads, head_dim, generator=gen).to(dtype)[:, 1]
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (query, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc)]


# --------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_reshape_and_cache_writes_each_token_to_its_slot_and_skips_negative_slots(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 32, 20
    # key and value as non-contiguous views of one fused [T, 2, Hkv, D] tensor
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn_like(key_cache)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    written = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[written]] = key[written]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[written]] = value[written]

    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))

    torch.testing.assert_close(key_cache.cpu(), expected_k, atol=0, rtol=0)
    torch.testing.assert_close(value_cache.cpu(), expected_v, atol=0, rtol=0)


def test_reshape_and_cache_rejects_a_head_dim_the_cache_does_not_have():
    key = torch.randn(4, 2, 32, device=DEVICE)
    cache = torch.randn(3, 8, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="cache holds"):
        reshape_and_cache(key, key, cache, cache.clone(), torch.arange(4, device=DEVICE))


# --------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------

# (block_size, head_dim, num_heads, num_kv_heads, dtype): every block size, head dim, GQA
# ratio and dtype appears at least once without running the full cross product.
DECODE_SHAPES = [
    (8, 32, 4, 4, torch.float32),
    (16, 64, 4, 2, torch.float32),
    (32, 128, 8, 2, torch.float16),
    (16, 128, 4, 1, torch.float16),
    (8, 64, 8, 2, torch.float16),
    (32, 32, 2, 1, torch.float32),
]


@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,dtype", DECODE_SHAPES)
def test_decode_matches_reference_on_ragged_batch(block_size, head_dim, num_heads, num_kv_heads, dtype):
    seq_lens = [1, 17, 70, 33, 5]
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, [1] * len(seq_lens), block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=block_size + head_dim)
    scale = head_dim ** -0.5
    expected = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, scale)
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens_t, scale,
                                 out=nan_like(query))
    assert_close(out, expected)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_decode_split_k_gives_the_same_answer_for_any_number_of_splits(num_splits):
    # With 8 splits of 64 tokens, the short sequences leave most of their splits empty.
    seq_lens = [300, 1, 130, 64, 65]
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, [1] * len(seq_lens), block_size=16, num_heads=4, num_kv_heads=2,
        head_dim=32, dtype=torch.float32, seed=num_splits, strided=True)
    expected = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.2)
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens_t, 0.2,
                                 num_splits=num_splits, out=nan_like(query))
    assert_close(out, expected)


def test_choose_num_splits_splits_long_contexts_only_when_the_batch_is_small():
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) > 8
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=10**6, num_sms=132) <= 64


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_long_context_with_automatic_splits_matches_reference(dtype):
    seq_lens = [2000, 777]
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, [1, 1], block_size=32, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, seed=7)
    expected = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.125)
    out = paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens_t, 0.125,
                                 out=nan_like(query))
    assert_close(out, expected)


# --------------------------------------------------------------------------------------
# prefill and mixed batches
# --------------------------------------------------------------------------------------

PREFILL_SHAPES = [
    (8, 64, 4, 2, torch.float32),
    (16, 32, 4, 1, torch.float16),
    (32, 128, 2, 2, torch.float16),
    (16, 64, 8, 2, torch.float32),
]


@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,dtype", PREFILL_SHAPES)
def test_mixed_batch_of_prefills_chunks_and_decodes_matches_reference(
        block_size, head_dim, num_heads, num_kv_heads, dtype):
    # fresh prompt, decode, chunk after a mid-block start, decode, prompt longer than a query tile,
    # and a sequence with nothing scheduled this step.
    q_lens = [7, 1, 9, 1, 40, 0]
    context = [0, 16, 37, 70, 0, 5]
    seq_lens = [c + q for c, q in zip(context, q_lens)]
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, q_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, seed=block_size * head_dim, strided=True)
    scale = head_dim ** -0.5
    expected = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, scale)
    out = paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, scale,
                                  out=nan_like(query))
    assert_close(out, expected)


def test_prefill_after_prefix_cache_hit_attends_to_the_cached_blocks():
    # Two requests share a 2-block cached prefix (same physical blocks in both tables) and
    # each computes only its own suffix; the second suffix spans two query tiles of 64 rows.
    block_size = 16
    q_lens, seq_lens = [11, 75], [32 + 11, 32 + 75]
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        seq_lens, q_lens, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=64,
        dtype=torch.float32, seed=3)
    block_tables[1, :2] = block_tables[0, :2]  # the shared prefix
    expected = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.125)
    out = paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.125,
                                  max_query_len=75, out=nan_like(query))
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_through_the_cache_equals_one_shot_attention(dtype):
    """Write each chunk's K/V with reshape_and_cache, attend with the chunk's queries only;
    the concatenated outputs equal attention over the whole prompt at once."""
    gen = torch.Generator().manual_seed(11)
    block_size, num_heads, num_kv_heads, head_dim, prompt_len = 8, 4, 2, 32, 45
    chunks = [13, 8, 1, 23]  # chunk boundaries fall mid-block
    q = torch.randn(prompt_len, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(prompt_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(prompt_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_blocks = 10
    table = torch.randperm(num_blocks, generator=gen)[: -(-prompt_len // block_size)].to(torch.int32)
    slots = (table.long()[torch.arange(prompt_len) // block_size] * block_size
             + torch.arange(prompt_len) % block_size)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn_like(key_cache)
    one_shot = paged_attention(q, k.view(1, prompt_len, num_kv_heads, head_dim),
                               v.view(1, prompt_len, num_kv_heads, head_dim),
                               torch.zeros(1, 1, dtype=torch.int32), torch.tensor([prompt_len]),
                               torch.tensor([0, prompt_len]), 0.3)

    q, k, v, slots = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
    key_cache, value_cache, block_tables = key_cache.to(DEVICE), value_cache.to(DEVICE), table[None].to(DEVICE)
    outputs, done = [], 0
    for n in chunks:
        rows = slice(done, done + n)
        reshape_and_cache(k[rows], v[rows], key_cache, value_cache, slots[rows])
        done += n
        outputs.append(triton_paged_attention(
            q[rows], key_cache, value_cache, block_tables,
            torch.tensor([done], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, n], dtype=torch.int32, device=DEVICE), 0.3, out=nan_like(q[rows])))
    assert_close(torch.cat(outputs).cpu(), one_shot)


# --------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------


def test_triton_paged_attention_uses_decode_kernel_only_when_every_query_len_is_one(monkeypatch):
    calls = []
    real_decode, real_prefill = kernels_module.paged_decode_attention, kernels_module.paged_prefill_attention
    monkeypatch.setattr(kernels_module, "paged_decode_attention",
                        lambda *a, **k: calls.append("decode") or real_decode(*a, **k))
    monkeypatch.setattr(kernels_module, "paged_prefill_attention",
                        lambda *a, **k: calls.append("prefill") or real_prefill(*a, **k))
    for q_lens, kind in [([1, 1, 1], "decode"), ([1, 2, 1], "prefill"), ([1, 0, 2], "prefill")]:
        seq_lens = [20, 9, 33]
        query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
            seq_lens, q_lens, block_size=8, num_heads=2, num_kv_heads=1, head_dim=32,
            dtype=torch.float32, seed=len(calls))
        expected = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.5)
        out = triton_paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.5,
                                     out=nan_like(query))
        assert calls[-1] == kind
        assert_close(out, expected)


def test_triton_paged_attention_allocates_output_when_none_given():
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        [12, 3], [4, 1], block_size=8, num_heads=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    expected = paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.5)
    out = triton_paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.5,
                                 max_query_len=4, max_seq_len=12)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert_close(out, expected)


def test_paged_attention_rejects_heads_that_do_not_divide_into_kv_heads():
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        [5], [1], block_size=8, num_heads=3, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        triton_paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.5)


@pytest.mark.skipif(DEVICE != "cpu", reason="only the CPU interpreter lacks bfloat16 arithmetic")
def test_interpreter_refuses_bfloat16_attention_instead_of_returning_garbage():
    query, key_cache, value_cache, block_tables, seq_lens_t, qsl = make_paged_batch(
        [5], [1], block_size=8, num_heads=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        triton_paged_attention(query, key_cache, value_cache, block_tables, seq_lens_t, qsl, 0.5)
