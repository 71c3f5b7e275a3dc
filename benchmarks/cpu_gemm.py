"""One projection of the default model on a CPU: torch's ``linear`` against MKL's prepacked GEMM.

stage5 runs every projection with ``torch.nn.functional.linear``. vLLM's CPU build hands each
linear layer to a kernel that reorders the weight once at load time into the layout its GEMM
reads fastest (``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``:
oneDNN's ``onednn_mm`` or sgl-kernel's ``weight_packed_linear``). torch exposes one such packed
GEMM for float32, MKL's (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, what
inductor's weight freezing uses). This times both on SmolLM2-135M's projection shapes (fused
QKV, fused gate-up, down) at decode-sized and prefill-sized batches, checks that they give the
same numbers, and states what the packed weight costs in memory. Side by side, one process.

    python -m benchmarks.cpu_gemm [--threads 2 --batch-sizes 16 64 512]
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results

# SmolLM2-135M: hidden 576, 9 + 2 * 3 heads of 64 (fused QKV), intermediate 1536 (fused gate-up).
SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576)}


def seconds_per_call(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(name: str, k: int, n: int, m: int, repeats: int) -> dict:
    x, weight = torch.randn(m, k), torch.randn(n, k)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
    same = torch.equal(torch.nn.functional.linear(x, weight), torch.ops.mkl._mkl_linear(x, packed, weight, None, m))
    flops = 2 * m * k * n
    plain = seconds_per_call(lambda: torch.nn.functional.linear(x, weight), repeats)
    mkl = seconds_per_call(lambda: torch.ops.mkl._mkl_linear(x, packed, weight, None, m), repeats)
    return {"projection": name, "k": k, "n": n, "m": m, "linear_gflops": flops / plain / 1e9,
            "packed_gflops": flops / mkl / 1e9, "identical": same,
            "packed_bytes_per_weight_byte": packed.numel() * packed.element_size() / (weight.numel() * 4)}


def to_markdown(result: dict) -> str:
    rows = result["rows"]
    details = f"{result['threads']} torch thread(s), load average {result['load_before']:.2f}"
    lines = [
        "### One projection: torch's linear against MKL's prepacked GEMM (float32)",
        "",
        f"{provenance(result, details)}.",
        "",
        "| projection (K x N) | batch M | linear GFLOP/s | packed GFLOP/s | packed / linear | same result |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['projection']} ({r['k']} x {r['n']}) | {r['m']} | {r['linear_gflops']:.0f} | "
                     f"{r['packed_gflops']:.0f} | {r['packed_gflops'] / r['linear_gflops']:.2f}x | "
                     f"{'bit-identical' if r['identical'] else 'differs'} |")
    size = max(r["packed_bytes_per_weight_byte"] for r in rows)
    lines += ["", f"The packed weight takes {size:.1f}x the bytes of the float32 weight it packs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "cpu_gemm")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 512])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.backends.mkl.is_available():
        raise SystemExit("this torch build has no MKL: nothing to compare")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    rows = [measure(name, k, n, m, args.repeats) for m in args.batch_sizes for name, (k, n) in SHAPES.items()]
    result = {**run_info("benchmarks.cpu_gemm", argv), "runtime_s": time.perf_counter() - start,
              "load_before": load_before, "threads": args.threads,
              "config": {"batch_sizes": args.batch_sizes, "repeats": args.repeats}, "rows": rows}
    write_results("cpu_gemm", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
