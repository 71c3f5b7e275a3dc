"""The C++ elementwise operators (RMSNorm, SiLU(gate) * up, RoPE) against the torch code, in one run.

Two parts, on the default model in bfloat16 (the CPU default where the CPU has bf16 units):

- each operator alone at the model's shapes (576 wide, gate/up 2 x 1536, 9 + 3 heads of 64) for 1,
  64 and 512 rows, against the torch code it replaces (``shared/model.py``'s ``RMSNorm``, ``F.silu``
  times up, ``model/fused.py``'s rotation), microseconds per call;
- the engine on ``cpu_peers``'s batch-64 workload (64 requests, 8,129 prompt and 5,435 output
  tokens, greedy, ``LLM()`` defaults otherwise) and a batch-1 request (128 tokens in, 128 out), with
  the operators and with ``STAGEDSERVE_CPU_ELEMENTWISE_KERNELS=0``, the two engines alternating for
  ``--rounds`` rounds (medians), and the two engines' greedy tokens on the workload's first 8
  requests compared with vLLM's ``check_logprobs_close`` (every divergence a near-tie).

    python -m benchmarks.cpu_elementwise [--rounds 2]
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from benchmarks.cpu_peers import batch_engine, greedy
from benchmarks.cpu_roofline import make_workload
from shared.closeness import as_token_logprobs, first_divergences
from shared.model import RMSNorm
from stage5_server.cpu_kernels.elementwise import SWITCH, CPUElementwiseKernels
from stage5_server.model.fused import _rotate_half

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M
ENGINES = {"operators": "1", "torch": "0"}


def microseconds(fn, repeats: int = 200) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def operator_rows(dtype: torch.dtype, m: int) -> list[dict]:
    """Each operator and its torch code on ``m`` rows."""
    kernels = CPUElementwiseKernels()
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    x = torch.randn(m, HIDDEN, dtype=dtype)
    gate_up = torch.randn(m, 2 * INTERMEDIATE, dtype=dtype)
    gate, up = gate_up.split(INTERMEDIATE, dim=-1)
    qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    q = qkv[:, :HEADS * HEAD_DIM].view(m, HEADS, HEAD_DIM)
    angles = torch.randn(m, 1, HEAD_DIM)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    pairs = {"RMSNorm": (lambda: norm(x), lambda: kernels.rms_norm(x, norm.weight, norm.eps)),
             "SiLU(gate) * up": (lambda: F.silu(gate) * up, lambda: kernels.silu_and_mul(gate_up)),
             "RoPE (q)": (lambda: _rotate_half(q, cos, sin), lambda: kernels.rotate_half(q, cos, sin))}
    return [{"op": name, "rows": m, "torch_us": microseconds(torch_fn), "operator_us": microseconds(operator)}
            for name, (torch_fn, operator) in pairs.items()]


def run_engine(switch: str, one: list[int], prompts, outputs, check: int) -> dict:
    os.environ[SWITCH] = switch  # read when the model loads
    llm = batch_engine()
    llm.generate([one[:16], one[:8]], greedy(4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([one], greedy(128), use_tqdm=False)
    batch1 = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, [greedy(n) for n in outputs], use_tqdm=False)
    batch = time.perf_counter() - start
    checked = llm.generate(prompts[:check], [greedy(n, logprobs=5) for n in outputs[:check]], use_tqdm=False)
    dtype = str(llm.dtype).removeprefix("torch.")
    del llm
    gc.collect()
    return {"dtype": dtype, "batch1_s": batch1, "batch_s": batch,
            "ids": [list(o.outputs[0].token_ids) for o in checked],
            "logprobs": [as_token_logprobs(o.outputs[0].logprobs) for o in checked]}


def markdown(result: dict) -> str:
    ops = result["operators"]
    lines = [f"### The elementwise operators against the torch code ({result['dtype']})", "",
             provenance(result, f"{result['threads']} torch threads, load average {result['load_average']}"), "",
             "| part | rows | torch µs | operator µs | torch / operator |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['op']} | {r['rows']} | {r['torch_us']:.0f} | {r['operator_us']:.0f} | "
              f"{r['torch_us'] / r['operator_us']:.2f}x |" for r in ops]
    engines = result["engines"]
    on, off = engines["operators"], engines["torch"]
    tokens = result["batch_output_tokens"]
    lines += ["", f"The engine (`LLM()` defaults, {result['dtype']}), medians of {result['rounds']} alternating "
              "rounds:", "", "| engine | batch 64 tok/s | batch 1 tok/s |", "|---|---:|---:|"]
    for name, row in (("with the operators", on), (f"`{SWITCH}=0`", off)):
        lines.append(f"| {name} | {tokens / row['batch_s']:.0f} | {128 / row['batch1_s']:.1f} |")
    lines += ["", f"Ratios (same run): batch 64 {off['batch_s'] / on['batch_s']:.2f}x, batch 1 "
                  f"{off['batch1_s'] / on['batch1_s']:.2f}x. Greedy tokens of the first {result['checked']} requests: "
                  f"{result['identical']} identical, the rest diverge at a near-tie: {result['all_close']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from shared.named_models import default_model
    from shared.tokenizer import Tokenizer

    ap = benchmark_parser(__doc__, "cpu_elementwise")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--check-requests", type=int, default=8)
    args = ap.parse_args(argv)
    result = {**run_info("benchmarks.cpu_elementwise", argv), "rounds": args.rounds, "checked": args.check_requests,
              "threads": torch.get_num_threads()}
    before = os.getloadavg()[0]
    model = default_model()
    text = "A serving engine keeps the keys and values of every token it has seen. "
    one = (Tokenizer(model).encode(text) * 16)[:128]
    prompts, outputs = make_workload(64, 0, 49152)
    result["batch_output_tokens"] = sum(outputs)
    runs: dict[str, list[dict]] = {name: [] for name in ENGINES}
    previous = os.environ.get(SWITCH)
    try:
        for i in range(args.rounds):
            for name in (list(ENGINES) if i % 2 == 0 else list(ENGINES)[::-1]):
                runs[name].append(run_engine(ENGINES[name], one, prompts, outputs, args.check_requests))
                print(f"round {i + 1}, {name}: batch 64 {runs[name][-1]['batch_s']:.2f} s")
    finally:
        os.environ.pop(SWITCH, None)
        if previous is not None:
            os.environ[SWITCH] = previous
    result["dtype"] = runs["operators"][0]["dtype"]
    dtype = getattr(torch, result["dtype"])
    result["operators"] = [row for m in (1, 64, 512) for row in operator_rows(dtype, m)]
    result["engines"] = {name: {key: statistics.median(r[key] for r in rs) for key in ("batch_s", "batch1_s")}
                         for name, rs in runs.items()}
    on, off = runs["operators"][0], runs["torch"][0]
    divergences = first_divergences(on["ids"], on["logprobs"], off["ids"], off["logprobs"])
    result["identical"] = args.check_requests - len(divergences)
    result["all_close"] = "yes" if all(d.close for d in divergences) else "no"
    result["load_average"] = f"{before:.2f} before, {os.getloadavg()[0]:.2f} after"
    write_results("cpu_elementwise", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
