"""Paged attention in Triton: the same math as ``stage2_paged.attention``, fused on the GPU.

The torch reference gathers each sequence's keys into a contiguous tensor and then runs
ordinary attention. These kernels never build that copy: each program walks the sequence's
block table itself, tile by tile, and keeps a running ("online") softmax so a context of any
length is read exactly once.

From block table to addresses (``_token_rows``): token position ``p`` of sequence ``i`` is in
logical block ``p // B`` at offset ``p % B``; the block table turns the logical block into a
physical one, so the token's K row starts at
``key_cache + block_tables[i, p // B] * stride_block + (p % B) * stride_slot``.
A tile of ``TILE_N`` consecutive positions may span several blocks (or part of one); every
position looks up its own block, so any block size works and blocks may sit anywhere.

Online softmax (every kernel's inner loop): keep, per query row, the running max ``m``, the
running sum of ``exp(score - m)`` ``l``, and the unnormalised output ``acc``. For each new
tile of scores ``s``: ``m' = max(m, max(s))``, rescale the old ``l`` and ``acc`` by
``exp(m - m')``, add ``exp(s - m')`` and ``exp(s - m') @ V``. At the end ``out = acc / l``.
All of it runs in float32 whatever the cache dtype.

Two kernels:

- ``paged_decode_attention``: one query per sequence (the decode step). One program per
  (sequence, KV head, split) computes all query heads that share that KV head (GQA), so the
  K/V tile is loaded once for the group. "Split-K" / flash-decoding: the context is cut into
  ``num_splits`` slices handled by different programs, each writing a partial ``(m, l, acc)``;
  a small reduce kernel merges them. A batch of a few long sequences then still has enough
  programs to fill the GPU.
- ``paged_prefill_attention``: any number of queries per sequence (prompt prefill, a chunk of
  a chunked prefill, prefill after a prefix-cache hit, decodes mixed in). One program per
  (sequence, tile of query rows, query head); query rows attend to every cached token before
  them and causally among themselves.

``triton_paged_attention`` has the signature of the torch reference and picks between them.

vLLM: ``vllm/attention/ops/triton_decode_attention.py`` (split-K decode) and
``vllm/attention/ops/triton_unified_attention.py`` (mixed prefill/decode over block tables).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stage5_server.kernels.reshape_and_cache import INTERPRET, check_device

# Split-K tuning: each split covers at least this many tokens, and we aim for about
# TARGET_WAVES programs per streaming multiprocessor before splitting further.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
TARGET_WAVES = 2

# float32 is the correctness reference, so tl.dot must not round its inputs to TF32. The
# option only concerns float32 inputs; fp16/bf16 always run on the tensor cores.
DOT_PRECISION = "ieee"

# Two K/V tiles in flight per program: enough to overlap loads with math, and it keeps the
# shared memory of a 128-token tile at head_dim 128 within what smaller GPUs have.
NUM_STAGES = 2


# ----------------------------------------------------------------------------------------
# Shared pieces of the kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _token_rows(block_table_ptr, positions, mask, BLOCK_SIZE: tl.constexpr,
                stride_block, stride_slot):
    """Offset (in elements) of each position's row in the cache, read via the block table."""
    physical_block = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=mask, other=0)
    return physical_block.to(tl.int64) * stride_block + (positions % BLOCK_SIZE) * stride_slot


@triton.jit
def _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of ``scores [M, N]`` (masked entries = -inf) and ``v [N, D]`` into
    the running max ``m_i``, running sum ``l_i`` and unnormalised output ``acc``."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)  # rescales what was summed under the old max; 0 on the first tile
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# ----------------------------------------------------------------------------------------
# Decode: one query token per sequence, split-K over the context
# ----------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale, tokens_per_split, num_splits,
    stride_qs, stride_qh, stride_qd,
    stride_os, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (tl.dot's minimum)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,  # tokens per inner-loop tile
    DIRECT: tl.constexpr,  # one split: write the final output, no reduce needed
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    # The GROUP query heads that read this KV head, as the rows of one small matrix.
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    for tile_start in range(split_start, split_end, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        n_mask = positions < split_end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = _token_rows(block_table, positions, n_mask, BLOCK_SIZE, stride_kb, stride_ks)
        v_rows = _token_rows(block_table, positions, n_mask, BLOCK_SIZE, stride_vb, stride_vs)
        k = tl.load(k_cache_ptr + k_rows[:, None] + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, TILE_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)

    if DIRECT:
        # A split that saw no token (seq_len 0, a padding entry) leaves l_i = 0: write zeros.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials are [num_seqs, num_heads, num_splits] (+ [HEAD_DIM] for acc), contiguous.
        # An empty split (it starts past seq_len) stores m = -inf, l = 0, acc = 0.
        rows = (seq * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + rows, m_i, mask=g_mask)
        tl.store(part_l_ptr + rows, l_i, mask=g_mask)
        tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    num_splits,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
):
    """Merge the splits of one (sequence, head): rescale every split to the global max.

    Split ``s`` holds ``l_s = sum exp(x - m_s)`` and ``acc_s = sum exp(x - m_s) v``. With
    ``M = max_s m_s`` and ``w_s = exp(m_s - M)``: ``out = sum_s w_s acc_s / sum_s w_s l_s``.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    rows = (seq * num_heads + head) * num_splits + offs_s
    m_s = tl.load(part_m_ptr + rows, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + rows, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)

    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (seq_len 0)
    weight = tl.exp(m_s - m_max)  # 0 for empty splits
    l_total = tl.sum(weight * l_s, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(l_total > 0, l_total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many slices to cut each context into.

    Enough programs to give every SM about ``TARGET_WAVES`` of them, but no slice shorter than
    ``MIN_TOKENS_PER_SPLIT`` tokens (a short slice costs more to merge than it saves) and at
    most ``MAX_SPLITS``. A big batch already fills the GPU and gets one split.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(TARGET_WAVES * num_sms, programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter on CPU: a nominal count, only the split choice depends on it


def _tile_n(block_size: int) -> int:
    # 64-token tiles are a good default on current GPUs; a bigger block is read whole.
    return max(64, triton.next_power_of_2(block_size))


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens):
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"query ({query.dtype}) and caches ({key_cache.dtype}, {value_cache.dtype}) "
                         "must share a dtype")
    if INTERPRET and query.dtype == torch.bfloat16:
        # Triton's CPU interpreter has no bfloat16 arithmetic: its tl.dot returns garbage.
        raise ValueError("bfloat16 attention cannot run under TRITON_INTERPRET=1; use float32 or float16 on CPU")
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("block_tables must be [num_seqs, max_blocks] with one row per entry of seq_lens")
    check_device(query, key_cache, value_cache, block_tables, seq_lens)
    # The kernels index a table row and seq_lens with unit stride (free when already so).
    return block_tables.contiguous(), seq_lens.contiguous()


def _check_out(out, query):
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence: ``query [num_seqs, H, D]`` -> ``[num_seqs, H, D]``.

    Row ``i`` of ``query`` is the newest token of sequence ``i``, already written to the cache,
    and attends to the ``seq_lens[i]`` tokens of its block table. ``max_seq_len`` must be at
    least every ``seq_lens[i]`` (default: read from ``seq_lens``, a device sync); it picks the
    number of splits. ``num_splits`` forces that number (at most one split per 64-token tile).
    """
    block_tables, seq_lens = _check_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_seqs != seq_lens.shape[0]:
        raise ValueError(f"decode takes one query per sequence: {num_seqs} queries, {seq_lens.shape[0]} seq_lens")
    out = _check_out(out, query)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    tile_n = _tile_n(block_size)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device))
    # Whole tiles per split, then drop splits that would start past the longest context.
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), tile_n) * tile_n
    num_splits = max(1, triton.cdiv(max_seq_len, tokens_per_split))

    group = num_heads // num_kv_heads
    direct = num_splits == 1
    if direct:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=query.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_m, part_l, part_acc,
        query, key_cache, value_cache, block_tables, seq_lens,
        scale, tokens_per_split, num_splits,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        DIRECT=direct,
        DOT_PRECISION=DOT_PRECISION,
        num_warps=4,
        num_stages=NUM_STAGES,
    )
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_m, part_l, part_acc,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


# ----------------------------------------------------------------------------------------
# Prefill (and mixed batches): many query tokens per sequence, causal
# ----------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    # This sequence's query rows are query[q_start : q_start + q_len]; the grid is sized for
    # the longest sequence, so most programs of short sequences have nothing to do.
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step (prefix hit, earlier chunks)

    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row index within this sequence's queries
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = context_len + offs_m  # absolute position of each query row
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    # Causality: no row of this tile looks past the tile's last row, so stop there.
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_M)
    for tile_start in range(0, kv_end, TILE_N):
        positions = tile_start + tl.arange(0, TILE_N)
        n_mask = positions < kv_end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = _token_rows(block_table, positions, n_mask, BLOCK_SIZE, stride_kb, stride_ks)
        v_rows = _token_rows(block_table, positions, n_mask, BLOCK_SIZE, stride_vb, stride_vs)
        k = tl.load(k_cache_ptr + k_rows[:, None] + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
        # Padding rows (offs_m >= q_len) sit past seq_len, so they see every key and never
        # produce an all -inf row (which would turn into NaN); they are not stored anyway.
        visible = n_mask[None, :] & (positions[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a ragged batch of prefills, prefill chunks and decodes in one launch.

    Same contract as ``stage2_paged.paged_attention``: ``query [T, H, D]`` packs every
    sequence's new tokens; sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
    and its row ``r`` sits at position ``seq_lens[i] - q_len_i + r``. ``max_query_len``
    (default: computed, a device sync) sizes the grid.
    """
    block_tables, seq_lens = _check_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    check_device(query, query_start_loc)
    query_start_loc = query_start_loc.contiguous()
    out = _check_out(out, query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len)))
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        TILE_N=_tile_n(block_size),
        DOT_PRECISION=DOT_PRECISION,
        num_warps=4,
        num_stages=NUM_STAGES,
    )
    return out


def triton_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Drop-in for ``stage2_paged.paged_attention``: the decode kernel when every sequence
    has exactly one query token, the prefill kernel otherwise.

    Pass ``max_query_len`` and ``max_seq_len`` (both in ``PagedAttentionMetadata``; each must be
    at least the true maximum) to avoid reading them back from the device; ``out`` receives the
    result if given.
    """
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    if max_query_len is None and num_tokens == num_seqs and num_seqs > 0:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if num_tokens == num_seqs and max_query_len == 1:  # T queries, T sequences, none longer than 1
        return paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                      max_seq_len=max_seq_len, out=out)
    return paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                   query_start_loc, scale, max_query_len=max_query_len, out=out)
