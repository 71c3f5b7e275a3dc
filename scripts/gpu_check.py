"""Check and time stage5's Triton kernels on a CUDA GPU.

    scripts/gpu_check.sh [--out benchmarks/results/gpu_check.json] [--quick] [--skip-engine]

1. Correctness: every kernel against the torch reference (``stage2_paged.paged_attention``)
   in bfloat16 (and float16), outputs poisoned with NaN first.
2. Decode bandwidth: ``paged_decode_attention`` timed with CUDA events (L2 flushed before each
   call) over batch sizes and context lengths; achieved bytes/s (the K/V it must read, plus
   queries, outputs and block tables) against the card's measured device-to-device copy
   bandwidth, with the stage2 torch reference timed on the small shapes for comparison.
3. Engine throughput (``engine_throughput``): offline ``stage5_server.LLM`` tokens/s with the
   triton and torch attention backends, skipped with a message if the engine is not ready.

Prints a table and writes JSON (date, GPU, versions, every number) to ``--out``. Exits 2 with a
message when no CUDA device is present, 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Max of |kernel - reference| / (1 + |reference|); the reference runs its softmax in float32.
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check.json"),
                   help="where to write the JSON results (default: %(default)s)")
    p.add_argument("--batches", default="1,4,16,64,256", help="decode batch sizes (default: %(default)s)")
    p.add_argument("--contexts", default="512,2048,8192,32768", help="decode context lengths (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=1 << 21,
                   help="skip shapes whose batch * context exceeds this many cached tokens (default: %(default)s)")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="timed calls per shape (default: %(default)s)")
    p.add_argument("--torch-max-tokens", type=int, default=1 << 17,
                   help="time the torch reference only up to this many cached tokens (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (batches 1,16,128; contexts 1024,8192)")
    p.add_argument("--skip-engine", action="store_true", help="skip the engine throughput hook")
    p.add_argument("--model", default=None,
                   help="checkpoint directory for the engine check (default: a Qwen3-0.6B-shaped random one)")
    p.add_argument("--engine-requests", type=int, default=64)
    p.add_argument("--engine-max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts = "1,16,128", "1024,8192"
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    return args


# ----------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------


def make_paged_batch(torch, seq_lens, q_lens, *, block_size, num_heads, num_kv_heads, head_dim, dtype,
                     seed=0, device="cuda"):
    """Random caches and queries; each sequence's blocks drawn from a shuffled pool (non-adjacent)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = pool[used:used + n]
        used += n
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc


# ----------------------------------------------------------------------------------------
# 1. correctness
# ----------------------------------------------------------------------------------------


def check_correctness(torch) -> list[dict]:
    from stage2_paged.attention import paged_attention
    from stage5_server.kernels import (
        paged_decode_attention,
        paged_prefill_attention,
        reshape_and_cache,
        triton_paged_attention,
    )

    results = []

    def record(name, dtype, fn, tol=None):
        dtype_name = str(dtype).replace("torch.", "")
        tol = TOLERANCE[dtype_name] if tol is None else tol
        try:
            err = fn()
            results.append({"check": name, "dtype": dtype_name, "max_err": err, "tolerance": tol,
                            "ok": math.isfinite(err) and err <= tol})
        except Exception as exc:  # a crash is a failed check, with its message in the JSON
            traceback.print_exc()
            results.append({"check": name, "dtype": dtype_name, "ok": False, "error": repr(exc)})
        r = results[-1]
        status = "ok  " if r["ok"] else "FAIL"
        print(f"  {status} {name:<58} {r['dtype']:<9} max_err={r.get('max_err', float('nan')):.2e}")

    def rel_err(actual, expected):
        if actual.isnan().any():
            return float("nan")
        diff = (actual.float() - expected.float()).abs()
        return float((diff / (1 + expected.float().abs())).max())

    def attention_case(kernel, seq_lens, q_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, **kw):
        def run():
            q, kc, vc, bt, sl, qsl = make_paged_batch(
                torch, seq_lens, q_lens, block_size=block_size, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=len(seq_lens) + head_dim)
            scale = head_dim ** -0.5
            expected = paged_attention(q, kc, vc, bt, sl, qsl, scale)
            out = torch.full_like(q, float("nan"))
            if kernel is paged_decode_attention:
                kernel(q, kc, vc, bt, sl, scale, out=out, **kw)
            else:
                kernel(q, kc, vc, bt, sl, qsl, scale, out=out, **kw)
            return rel_err(out, expected)
        return run

    def cache_case(dtype):
        def run():
            gen = torch.Generator(device="cuda").manual_seed(0)
            num_blocks, block_size, hkv, d, t = 64, 16, 8, 128, 300
            kv = torch.randn(t, 2, hkv, d, generator=gen, device="cuda").to(dtype)
            slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:t]
            slots[::7] = -1
            kc = torch.randn(num_blocks, block_size, hkv, d, generator=gen, device="cuda").to(dtype)
            vc = torch.randn_like(kc)
            ek, ev = kc.clone(), vc.clone()
            keep = slots >= 0
            ek.view(-1, hkv, d)[slots[keep]] = kv[:, 0][keep]
            ev.view(-1, hkv, d)[slots[keep]] = kv[:, 1][keep]
            reshape_and_cache(kv[:, 0], kv[:, 1], kc, vc, slots)
            return float(max((kc.float() - ek.float()).abs().max(), (vc.float() - ev.float()).abs().max()))
        return run

    ragged = [1, 17, 300, 2049, 4096, 77]
    for dtype in (torch.bfloat16, torch.float16):
        record("reshape_and_cache (exact copy, skipped slots)", dtype, cache_case(dtype), tol=0.0)
        record("decode, auto splits, B16 D128 H32/8", dtype,
               attention_case(paged_decode_attention, ragged, [1] * 6, 16, 32, 8, 128, dtype))
        record("decode, 1 split, B16 D128 H32/8", dtype,
               attention_case(paged_decode_attention, ragged, [1] * 6, 16, 32, 8, 128, dtype, num_splits=1))
        record("decode, 7 splits, B32 D64 H8/8", dtype,
               attention_case(paged_decode_attention, ragged, [1] * 6, 32, 8, 8, 64, dtype, num_splits=7))
        record("decode, 1 long seq (auto splits), B8 D32 H8/2", dtype,
               attention_case(paged_decode_attention, [20000], [1], 8, 8, 2, 32, dtype))
        context, q_lens = [0, 500, 37, 0, 1000, 64], [300, 120, 1, 1, 1, 129]
        seq_lens = [c + q for c, q in zip(context, q_lens)]
        record("prefill, mixed batch + prefix hits, B16 D128 H32/8", dtype,
               attention_case(paged_prefill_attention, seq_lens, q_lens, 16, 32, 8, 128, dtype))
        record("prefill, mixed batch + prefix hits, B32 D64 H16/4", dtype,
               attention_case(paged_prefill_attention, seq_lens, q_lens, 32, 16, 4, 64, dtype))
        record("dispatch: triton_paged_attention on decodes", dtype,
               attention_case(triton_paged_attention, ragged, [1] * 6, 16, 32, 8, 128, dtype))
        record("dispatch: triton_paged_attention on mixed batch", dtype,
               attention_case(triton_paged_attention, seq_lens, q_lens, 16, 32, 8, 128, dtype))
    return results


# ----------------------------------------------------------------------------------------
# 2. decode bandwidth
# ----------------------------------------------------------------------------------------


def measure_copy_bandwidth(torch, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def time_cuda(torch, fn, iters: int, flush) -> float:
    """Mean milliseconds per call, L2 flushed before each call, measured with CUDA events."""
    for _ in range(3):
        fn()
    total = 0.0
    events = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    for start, end in events:
        total += start.elapsed_time(end)
    return total / iters


def bench_decode(torch, args, copy_bw: float) -> list[dict]:
    from stage2_paged.attention import paged_attention
    from stage5_server.kernels import choose_num_splits, paged_decode_attention
    from stage5_server.kernels.paged_attention import _num_sms

    dtype = torch.bfloat16
    elem = torch.finfo(dtype).bits // 8
    bs, h, hkv, d = args.block_size, args.num_heads, args.num_kv_heads, args.head_dim
    shapes = [(b, c) for c in args.contexts for b in args.batches]
    runnable = [(b, c) for b, c in shapes if b * c <= args.max_tokens]
    if not runnable:
        return []
    pool_blocks = max(b * -(-c // bs) for b, c in runnable)
    gen = torch.Generator(device="cuda").manual_seed(0)
    key_cache = torch.randn(pool_blocks, bs, hkv, d, generator=gen, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than any L2
    sms = _num_sms(torch.device("cuda"))

    rows = []
    for batch, ctx in shapes:
        if batch * ctx > args.max_tokens:
            rows.append({"batch": batch, "context": ctx, "skipped": f"batch*context > --max-tokens {args.max_tokens}"})
            continue
        blocks = -(-ctx // bs)
        perm = torch.randperm(pool_blocks, generator=gen, device="cuda")[: batch * blocks]
        block_tables = perm.to(torch.int32).view(batch, blocks)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, h, d, generator=gen, device="cuda", dtype=dtype)
        out = torch.empty_like(query)
        scale = d ** -0.5

        run = functools.partial(paged_decode_attention, query, key_cache, value_cache, block_tables,
                                seq_lens, scale, max_seq_len=ctx, out=out)
        ms = time_cuda(torch, run, args.iters, flush)
        nbytes = (2 * batch * ctx * hkv * d * elem  # K and V: the bytes that must be read
                  + 2 * query.numel() * elem + block_tables.numel() * 4 + seq_lens.numel() * 4)
        row = {"batch": batch, "context": ctx, "num_splits": choose_num_splits(batch, hkv, ctx, sms),
               "ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6, "frac_of_copy_bw": nbytes / (ms / 1e3) / copy_bw}
        if batch * ctx <= args.torch_max_tokens:
            qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            reference = functools.partial(paged_attention, query, key_cache, value_cache, block_tables,
                                          seq_lens, qsl, scale)
            row["torch_ms"] = time_cuda(torch, reference, max(3, args.iters // 4), flush)
        rows.append(row)
        print_row(row)
    return rows


def print_header():
    print(f"  {'batch':>5} {'context':>7} {'splits':>6} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'torch ms':>9}")


def print_row(row):
    torch_ms = f"{row['torch_ms']:9.3f}" if "torch_ms" in row else f"{'-':>9}"
    print(f"  {row['batch']:>5} {row['context']:>7} {row['num_splits']:>6} {row['ms']:9.3f} "
          f"{row['gbps']:8.0f} {100 * row['frac_of_copy_bw']:6.1f}% {torch_ms}")


# ----------------------------------------------------------------------------------------
# 3. engine throughput (HOOK)
# ----------------------------------------------------------------------------------------


def engine_throughput(args) -> dict:
    """HOOK: offline generation throughput of ``stage5_server.LLM``, triton vs torch backend.

    The engine is written alongside the kernels; every step that may not exist yet (the
    package, ``LLM``'s ``attention_backend``/``device`` arguments, a checkpoint builder) is
    guarded, and what was skipped is printed and recorded instead of failing the run.
    """
    if args.skip_engine:
        return {"skipped": "--skip-engine"}
    try:
        import stage5_server
        from shared import SamplingParams
        llm_cls = stage5_server.LLM
    except Exception as exc:
        print(f"  skipped: stage5_server.LLM is not importable ({exc!r})")
        return {"skipped": f"import failed: {exc!r}"}

    model = args.model
    if model is None:  # a Qwen3-0.6B-shaped checkpoint with random weights, built on the spot
        try:
            from course.tiny_model import QWEN3_0_6B, make_tiny_model
            print("  building a Qwen3-0.6B-shaped random checkpoint ...")
            model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="gpu_check_model_")), arch="qwen3",
                                        size=QWEN3_0_6B))
        except Exception as exc:
            print(f"  skipped: no checkpoint ({exc!r}); pass --model")
            return {"skipped": "no checkpoint available"}

    prompts = [f"Request {i}: write a short story about a serving engine that pages its cache."
               for i in range(args.engine_requests)]
    results: dict = {"model": str(model), "requests": len(prompts), "max_tokens": args.engine_max_tokens}
    token_ids = {}
    for backend in ("triton", "torch"):
        try:
            llm = llm_cls(model=model, attention_backend=backend, device="cuda", seed=0, max_model_len=4096,
                          max_num_seqs=args.engine_requests, max_num_batched_tokens=8192)
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # compile / warm up
            params = SamplingParams(temperature=0, max_tokens=args.engine_max_tokens, ignore_eos=True)
            import torch
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            token_ids[backend] = [list(o.outputs[0].token_ids) for o in outs]
            results[backend] = {"seconds": seconds, "generated_tokens": generated,
                                "tokens_per_s": generated / seconds}
            print(f"  {backend:<6} {generated} tokens in {seconds:.2f} s: {generated / seconds:,.0f} tok/s")
            del llm
            torch.cuda.empty_cache()
        except Exception as exc:
            print(f"  skipped backend {backend}: {exc!r}")
            results[backend] = {"skipped": repr(exc)}
    if len(token_ids) == 2:
        same = sum(a == b for a, b in zip(token_ids["triton"], token_ids["torch"]))
        # bf16 kernels round differently from the torch path, so long greedy runs may diverge.
        results["greedy_identical_requests"] = f"{same}/{len(prompts)}"
        print(f"  greedy outputs identical across backends: {same}/{len(prompts)} requests")
    return results


# ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing checked. "
              "Run this script on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_check: unset TRITON_INTERPRET; this script runs the compiled kernels on the GPU.",
              file=sys.stderr)
        return 2
    import triton

    gpu = torch.cuda.get_device_name()
    report: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "host": platform.node(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__, "cuda": torch.version.cuda},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(f"gpu_check on {gpu} (torch {torch.__version__}, triton {triton.__version__})")

    print("\n[1] correctness against the torch reference")
    report["correctness"] = check_correctness(torch)
    failed = [r for r in report["correctness"] if not r["ok"]]

    print("\n[2] paged decode attention, bf16, "
          f"H={args.num_heads} Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size}")
    copy_bw = measure_copy_bandwidth(torch)
    report["copy_bandwidth_gbps"] = copy_bw / 1e9
    print(f"  measured device-to-device copy bandwidth: {copy_bw / 1e9:,.0f} GB/s")
    print_header()
    report["decode"] = bench_decode(torch, args, copy_bw)
    torch.cuda.empty_cache()  # the benchmark's caches are garbage now; free them for the engine

    print("\n[3] engine throughput (stage5_server.LLM, offline)")
    try:
        report["engine"] = engine_throughput(args)
    except Exception as exc:  # the hook must never lose the kernel results above
        traceback.print_exc()
        report["engine"] = {"error": repr(exc)}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    if failed:
        print(f"gpu_check: {len(failed)} correctness check(s) FAILED: "
              + ", ".join(f"{r['check']} [{r['dtype']}]" for r in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
