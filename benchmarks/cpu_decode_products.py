"""A decode step's products on a CPU: bound by the weights they stream, not by the FLOPs.

A decode batch of a few dozen rows multiplies every weight of the model once a step. On a CPU
with AMX, oneDNN's bfloat16 GEMM computes such a product several times faster than the weights
arrive from memory, so the step's products take about the time their weights take to stream,
whatever the row count. For the default model's shapes (the layers' four products: QKV, the
attention output, gate and up, down), each layer with weights of its own so that no call finds
the last one's in cache, at 16, 43 (the batch-64 workload's mean decode batch) and 64 rows, one
run measures the time of a step's products (every layer once):

- ``bf16 packed``: oneDNN's GEMM over weights packed at load (``quantization/packed.py``, what the
  engine runs for a decode batch of more than 8 rows); where oneDNN cannot pack bfloat16 (a CPU without
  AVX-512), the engine's fallback, the plain weights through ``F.linear``, and the result says so;
- ``bf16 packed, hot``: the same products, one layer's weights used for every layer, so they come
  from the caches: closer to what a GEMM measured alone reports;
- ``int8 (W8A8)``: oneDNN's int8 GEMM (``torch.ops.onednn.qlinear_pointwise``, per-channel int8
  weights), which streams half the bytes: the GEMM alone on rows quantized beforehand, and with
  each product's rows quantized to uint8 by torch operators first; not an engine path;
- ``read``: a sum over the same bytes, the floor of any kernel that streams the bfloat16 weights.

``--engine`` adds the engine on ``cpu_peers``'s batch-64 workload (``LLM()`` defaults) under
``torch.profiler``: each packed product's GFLOP/s by weight shape, in decode steps (at most 64
rows) and in steps that hold prefill chunks.

    python -m benchmarks.cpu_decode_products [--rows 16 43 64 --layers 30 --engine]
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

from benchmarks.common import benchmark_parser, best_seconds, provenance, run_info, write_results
from stage5_server.quantization.packed import pack_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # SmolLM2-135M: (N, K)


def int8_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise") and \
        torch.backends.mkldnn.is_available()


def _int8_weight(weight: torch.Tensor, rows: int):
    """Per-channel int8 weight, packed for oneDNN, and its scales."""
    scales = weight.abs().amax(1).clamp(min=1e-8) / 127
    quantized = torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return torch.ops.onednn.qlinear_prepack(quantized, [rows, weight.shape[1]]), scales


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """x (float) as uint8 over its range: (values, scale, zero point)."""
    lo, hi = x.aminmax()
    scale = max((hi - lo).item() / 255, 1e-8)
    zero = int(round(-lo.item() / scale))
    return torch.clamp(torch.round(x / scale) + zero, 0, 255).to(torch.uint8), scale, zero


def _int8_gemm(xq: torch.Tensor, scale: float, zero: int, packed, scales: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros_like(scales, dtype=torch.long)
    return torch.ops.onednn.qlinear_pointwise(xq, scale, zero, packed, scales, zeros, None, 1.0, 0, torch.bfloat16,
                                              "none", [], "")


def _int8_product(x: torch.Tensor, packed, scales: torch.Tensor) -> torch.Tensor:
    """x quantized to uint8, times the int8 weight, out in bfloat16."""
    return _int8_gemm(*_quantize_rows(x), packed, scales)


def measure(rows: int, layers: int, repeats: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    weights = {name: [torch.randn(n, k, generator=gen) * k ** -0.5 for _ in range(layers)]
               for name, (n, k) in SHAPES.items()}
    inputs = {name: torch.randn(rows, k, generator=gen) for name, (_, k) in SHAPES.items()}
    # packed as the engine packs (quantization/packed.py); where oneDNN refuses bfloat16 (a CPU without
    # AVX-512), the engine's fallback: the plain weight through F.linear
    packed = {name: [pack_weight(w.bfloat16()) for w in ws] for name, ws in weights.items()}
    is_packed = all(p is not None for ps in packed.values() for p in ps)
    if not is_packed:
        packed = {name: [w.bfloat16() for w in ws] for name, ws in weights.items()}
    x_bf16 = {name: x.bfloat16() for name, x in inputs.items()}

    def bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if is_packed:
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return torch.nn.functional.linear(x, weight)

    def bf16_step(hot: bool = False):
        for layer in range(layers):
            for name in SHAPES:
                bf16_product(x_bf16[name], packed[name][0 if hot else layer])

    flops = 2 * rows * layers * sum(n * k for n, k in SHAPES.values())
    weight_bytes = 2 * layers * sum(n * k for n, k in SHAPES.values())
    row = {"rows": rows, "layers": layers, "gflop": flops / 1e9, "weight_mb": weight_bytes / 1e6,
           "bf16_weights": "packed" if is_packed else "plain (could not pack)",
           "bf16_packed_ms": best_seconds(bf16_step, repeats) * 1e3,
           "bf16_packed_hot_ms": best_seconds(lambda: bf16_step(hot=True), repeats) * 1e3}
    flat = torch.cat([w.bfloat16().flatten() for ws in weights.values() for w in ws])
    row["read_ms"] = best_seconds(flat.sum, repeats) * 1e3
    if int8_available():
        int8 = {name: [_int8_weight(w, rows) for w in ws] for name, ws in weights.items()}
        reference = torch.nn.functional.linear(inputs["o"], weights["o"][0])
        got = _int8_product(inputs["o"], *int8["o"][0]).float()
        row["int8_relative_error"] = ((got - reference).norm() / reference.norm()).item()
        row["bf16_relative_error"] = ((bf16_product(x_bf16["o"], packed["o"][0]).float() - reference).norm()
                                      / reference.norm()).item()

        quantized = {name: _quantize_rows(x) for name, x in inputs.items()}

        def int8_step(quantize: bool):
            for layer in range(layers):
                for name in SHAPES:
                    if quantize:
                        _int8_product(inputs[name], *int8[name][layer])
                    else:
                        _int8_gemm(*quantized[name], *int8[name][layer])

        row["int8_ms"] = best_seconds(lambda: int8_step(True), repeats) * 1e3
        row["int8_gemm_ms"] = best_seconds(lambda: int8_step(False), repeats) * 1e3
    return row


def profile_engine() -> list[dict]:
    """The engine on cpu_peers's batch-64 workload: its packed products' GFLOP/s by shape and step kind."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.cpu_peers import BATCH, batch_engine, greedy
    from benchmarks.cpu_roofline import make_workload

    prompts, outputs = make_workload(64, 0, 49152)
    llm = batch_engine()
    llm.generate(prompts, [greedy(n) for n in outputs], use_tqdm=False)  # warm-up: the same run once
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        llm.generate(prompts, [greedy(n) for n in outputs], use_tqdm=False)
    llm.shutdown()
    groups = defaultdict(lambda: {"calls": 0, "seconds": 0.0, "flops": 0})
    for event in prof.events():
        if event.name != "mkldnn::_linear_pointwise":
            continue
        x = event.input_shapes[0]
        rows, k = x[0] if len(x) == 2 else x[0] * x[1], x[-1]
        n = event.input_shapes[1][0]  # the packed weight's first dimension: its output features
        group = groups[("decode" if rows <= BATCH["max_num_seqs"] else "mixed", n, k)]
        group["calls"] += 1
        group["seconds"] += event.self_cpu_time_total / 1e6
        group["flops"] += 2 * rows * n * k
    return [{"step": step, "n": n, "k": k, **g, "mean_rows": g["flops"] / (2 * n * k * g["calls"]),
             "gflops": g["flops"] / g["seconds"] / 1e9}
            for (step, n, k), g in sorted(groups.items(), key=lambda item: -item[1]["seconds"])]


def markdown(result: dict) -> str:
    lines = ["### A decode step's products: the weights they stream", "",
             provenance(result, f"{result['threads']} torch threads, load average {result['load_average']}") + ".",
             "", f"The default model's four products per layer, {result['rows'][0]['layers']} layers with weights "
                 "of their own, the best of "
                 f"{result['repeats']} steps; GB/s is the bfloat16 weights' bytes over the step's time.", "",
             *([] if result["rows"][0].get("bf16_weights", "packed") == "packed" else [
                 "oneDNN cannot pack bfloat16 weights on this CPU (it needs AVX-512 or AVX-NE-CONVERT): the bf16 "
                 "columns are the engine's fallback there, the plain weights through `F.linear`.", ""]),
             "| rows | GFLOP | bf16 packed ms | GFLOP/s | weights GB/s | bf16 packed, hot ms | hot GFLOP/s | "
             "int8 GEMM ms | int8 GEMM + quantizing ms | read ms | read GB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        cold, hot, read = r["bf16_packed_ms"], r["bf16_packed_hot_ms"], r["read_ms"]
        int8 = f"{r['int8_gemm_ms']:.1f} | {r['int8_ms']:.1f}" if "int8_ms" in r else "n/a | n/a"
        lines.append(f"| {r['rows']} | {r['gflop']:.2f} | {cold:.1f} | {r['gflop'] / cold * 1e3:.0f} | "
                     f"{r['weight_mb'] / cold:.1f} | {hot:.1f} | {r['gflop'] / hot * 1e3:.0f} | {int8} | {read:.1f} | "
                     f"{r['weight_mb'] / read:.1f} |")
    errors = [r for r in result["rows"] if "int8_relative_error" in r]
    if errors:
        lines += ["", "Relative error of one product (the attention output's, random weights) against float32: "
                      f"bfloat16 {errors[0]['bf16_relative_error']:.4f}, int8 (W8A8) "
                      f"{errors[0]['int8_relative_error']:.4f}."]
    if "engine" in result:
        lines += ["", "The engine on the batch-64 workload, its packed products by weight shape (N x K) and step "
                      "(decode: at most 64 rows; mixed: with prefill chunks):", "",
                  "| step | weight | calls | mean rows | seconds | GFLOP/s |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {g['step']} | {g['n']} x {g['k']} | {g['calls']} | {g['mean_rows']:.0f} | {g['seconds']:.2f} | "
                  f"{g['gflops']:.0f} |" for g in result["engine"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "cpu_decode_products")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 43, 64])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="also profile the engine's products on the batch-64 workload")
    args = ap.parse_args(argv)
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        raise SystemExit("nothing to measure: this torch has no oneDNN linear packing")
    before = os.getloadavg()[0]
    result = {**run_info("benchmarks.cpu_decode_products", argv), "threads": torch.get_num_threads(),
              "repeats": args.repeats,
              "rows": [measure(rows, args.layers, args.repeats) for rows in args.rows]}
    if args.engine:
        result["engine"] = profile_engine()
    result["load_average"] = f"{before:.2f} before, {os.getloadavg()[0]:.2f} after"
    write_results("cpu_decode_products", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
