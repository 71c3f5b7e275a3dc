"""An int8 weight on a CPU: torch's ``_weight_int8pack_mm`` against stage5's integer operator.

Both multiply the same per-row int8 weight. torch's kernel widens each weight to the activations'
float dtype; ``torch.ops.stagedserve_cpu.int8_linear`` (``stage5_server/cpu_kernels/``) quantizes
the activations to int8 in groups of 64 and sums int8 products in int32 with AVX512-VNNI. Timed
side by side in one process on the default model's shapes (its 49,152 x 576 LM head, a fused
QKV, gate-up and down projection as int8), bfloat16 activations, at decode-sized row counts; with
each one's largest error against the exact product of the same int8 weight, relative to the
largest output.

    python -m benchmarks.int8_linear [--rows 1 4 8 --threads 2]
"""

from __future__ import annotations

import os

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from benchmarks.cpu_gemm import seconds_per_call

SHAPES = {"lm_head": (49152, 576), "qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)


def measure(name: str, n: int, k: int, rows: int, repeats: int) -> dict:
    from stage5_server.cpu_kernels.int8_linear import cpu_int8_linear
    from stage5_server.quantization.weight_only import quantize_int8

    generator = torch.Generator().manual_seed(0)
    weight, scale = quantize_int8(torch.randn(n, k, generator=generator) * 0.05)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    exact = x.double() @ (weight.double() * scale.double()[:, None]).T
    scale_bf16 = scale.bfloat16()
    torch_out = torch.ops.aten._weight_int8pack_mm(x, weight, scale_bf16)
    ours = cpu_int8_linear(x, weight, scale)
    largest = exact.abs().max().item()
    result = {"name": name, "n": n, "k": k, "rows": rows,
              "torch_ms": 1e3 * seconds_per_call(lambda: torch.ops.aten._weight_int8pack_mm(x, weight, scale_bf16),
                                                  repeats),
              "int8_ms": 1e3 * seconds_per_call(lambda: cpu_int8_linear(x, weight, scale), repeats),
              "torch_error": (torch_out.double() - exact).abs().max().item() / largest,
              "int8_error": (ours.double() - exact).abs().max().item() / largest}
    result["speedup"] = result["torch_ms"] / result["int8_ms"]
    return result


def to_markdown(result: dict) -> str:
    lines = ["### An int8 weight: torch's kernel against int8 activations (AVX512-VNNI)", "",
             provenance(result, f"{result['threads']} torch threads; load average {result['load_average'][0]:.2f}")
             + "; bfloat16 activations.", "",
             "| weight N x K | rows | torch ms | int8 operator ms | speedup | error, torch | error, int8 operator |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} {r['n']} x {r['k']} | {r['rows']} | {r['torch_ms']:.3f} | {r['int8_ms']:.3f} | "
                     f"{r['speedup']:.2f}x | {r['torch_error']:.1e} | {r['int8_error']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "int8_linear")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    from stage5_server.cpu_kernels.int8_linear import int8_dot_problem

    problem = int8_dot_problem()
    if problem:
        raise SystemExit(f"the int8 operator is not the fast path here: {problem}")
    torch.set_num_threads(args.threads)
    result = {**run_info("benchmarks.int8_linear", argv), "threads": args.threads, "load_average": os.getloadavg(),
              "rows": [measure(name, n, k, rows, args.repeats)
                       for name, (n, k) in SHAPES.items() for rows in args.rows]}
    write_results("int8_linear", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
