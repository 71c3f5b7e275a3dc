"""Tensor parallelism on this machine: the same workload on 1 rank and on N ranks, side by side.

Each size runs stage5's ``LLM`` (torch attention backend) on the same prompts with greedy
decoding; the benchmark checks that every size produced the same tokens, then reports start-up
time, wall time and output tokens/s. Every rank computes with ``--threads-per-rank`` torch
threads (default 1: more threads than free cores make a CPU run measure oversubscription, not
the model). On a CPU this shows what the split costs (two all-reduces per layer, one step
message per rank), not what it gains: on GPUs the gain is memory (weights and KV per device)
and bandwidth, which a CPU run cannot show.

    python -m benchmarks.tensor_parallel [--sizes 1 2 --model small --num-requests 16 --threads-per-rank 1]
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams, resolve_model
from stage5_server import LLM


def measure(model: str, size: int, prompts: list[list[int]], output_len: int) -> dict:
    start = time.perf_counter()
    llm = LLM(model=model, tensor_parallel_size=size, device="cpu", attention_backend="torch", block_size=16,
              max_model_len=512, max_num_seqs=len(prompts), max_num_batched_tokens=1024, kv_cache_memory=64 << 20,
              enable_prefix_caching=False)
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    return {"tensor_parallel_size": size, "startup_s": startup, "wall_s": wall,
            "output_tokens_per_s": sum(map(len, tokens)) / wall, "tokens": tokens}


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "### Tensor parallelism on CPU (correctness, not speed)",
        "",
        provenance(result, f"{cfg['threads_per_rank']} torch thread(s) per rank") + "; model "
        f"`{cfg['model']}`, {cfg['num_requests']} requests of {cfg['prompt_len']} prompt tokens, "
        f"{cfg['output_len']} greedy output tokens each. Same tokens on every size: "
        f"**{result['same_tokens']}**.",
        "",
        "| ranks | start-up s | wall s | output tok/s | vs 1 rank |",
        "|---:|---:|---:|---:|---:|",
    ]
    base = result["rows"][0]["output_tokens_per_s"]
    for r in result["rows"]:
        lines.append(f"| {r['tensor_parallel_size']} | {r['startup_s']:.1f} | {r['wall_s']:.2f} | "
                     f"{r['output_tokens_per_s']:.0f} | {r['output_tokens_per_s'] / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "tensor_parallel")
    ap.add_argument("--model", default="small", help="tiny, small (default), default, or a checkpoint dir")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    args = ap.parse_args(argv)
    model = resolve_model(args.model)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(args.prompt_len)] for i in range(args.num_requests)]
    torch.set_num_threads(args.threads_per_rank)  # one rank computes in this process
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_rank)  # the workers of N ranks read it
    rows = [measure(model, size, prompts, args.output_len) for size in args.sizes]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    for r in rows:
        del r["tokens"]
    result = {**run_info("benchmarks.tensor_parallel", argv),
              "config": {"model": Path(model).name, "threads_per_rank": args.threads_per_rank,
                         "num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "output_len": args.output_len},
              "same_tokens": same, "rows": rows}
    write_results("tensor_parallel", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
