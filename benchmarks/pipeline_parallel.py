"""Pipeline parallelism on this machine: one rank, two pipeline stages and two tensor-parallel ranks on
the same workload, at two concurrencies, side by side in one run; and each rank's busy time per step.

Each layout runs stage5's ``LLM`` (torch attention backend, greedy) on the same prompts, all
submitted at once: ``--concurrency`` requests per round. It reports output tokens/s and the mean time
to first token, checks that every layout produced the same tokens, and records for the two-stage
layout when each rank worked (``Worker.timeline``; a stage's waits for its neighbours, to receive
or to hand over hidden states, are not counted). The timeline plot shows the bubble: with one
request, one stage works while the other waits; with many, the batch queue keeps a batch on each
stage.

On a CPU with few cores this is a correctness exercise: the ranks share the cores (one thread each),
so splitting cannot add compute. What pipeline parallelism buys on GPUs is memory (each device holds
1/P of the layers and their KV) and a hand-over per step instead of TP's two all-reduces per layer.

    python -m benchmarks.pipeline_parallel [--model small --concurrency 1 16 --output-len 32]
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, save_figure, write_results
from shared import SamplingParams, resolve_model
from stage5_server import LLM

LAYOUTS = ((1, 1), (1, 2), (2, 1))  # (tensor_parallel_size, pipeline_parallel_size)


def start_timeline(worker) -> None:
    worker.timeline = []


def take_timeline(worker) -> list[tuple[float, float]]:
    timeline, worker.timeline = worker.timeline, None
    return timeline


def run_round(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """Every prompt at once; wall time, mean time to first token, the tokens."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [llm.add_request(prompt, params) for prompt in prompts]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = time.perf_counter() - start
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "ttft_s": sum(first.values()) / len(first),
            "tokens": [tokens[i] for i in ids]}


def measure(model: str, tp: int, pp: int, prompts: list[list[int]], concurrencies: list[int],
            output_len: int) -> tuple[list[dict], dict]:
    llm = LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, device="cpu",
              attention_backend="torch", block_size=16, max_model_len=512, max_num_seqs=max(concurrencies),
              max_num_batched_tokens=512, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    rows, timelines = [], {}
    try:
        run_round(llm, prompts[:2], 4)  # warm-up
        for concurrency in concurrencies:
            executor = llm.engine.model_executor
            if pp > 1:
                executor.collective_rpc(start_timeline)
            result = run_round(llm, prompts[:concurrency], output_len)
            if pp > 1:
                timelines[concurrency] = executor.collective_rpc(take_timeline)
            generated = sum(map(len, result["tokens"]))
            rows.append({"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "concurrency": concurrency,
                         "wall_s": result["wall_s"], "ttft_s": result["ttft_s"],
                         "output_tokens_per_s": generated / result["wall_s"], "tokens": result["tokens"]})
    finally:
        llm.shutdown()
    return rows, timelines


def busy_fraction(timeline: list[tuple[float, float]], begin: float, end: float) -> float:
    return sum(b - a for a, b in timeline) / (end - begin)


def plot(timelines: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 1.6 * len(timelines) + 0.6), squeeze=False)
    for ax, (concurrency, ranks) in zip(axes[:, 0], sorted(timelines.items())):
        origin = min(a for timeline in ranks for a, _ in timeline)
        window = [(a - origin, b - a) for a, b in ranks[0]]
        horizon = window[min(len(window) - 1, 11)][0] + window[min(len(window) - 1, 11)][1]  # about 12 steps
        for rank, timeline in enumerate(ranks):
            bars = [(a - origin, b - a) for a, b in timeline if a - origin <= horizon]
            ax.broken_barh(bars, (rank - 0.35, 0.7), color=f"C{rank}")
        ax.set_xlim(0, horizon)
        ax.set_yticks(range(len(ranks)), [f"stage {r}" for r in range(len(ranks))])
        ax.set_title(f"{concurrency} request(s) in flight", fontsize=10)
    axes[-1, 0].set_xlabel("seconds (first steps of the round)")
    fig.suptitle("Pipeline parallelism, 2 stages: when each stage works (gaps: the bubble)", fontsize=11)
    save_figure(fig, path)


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = ["### Pipeline and tensor parallelism on CPU (correctness, not speed)", "",
             provenance(result, f"1 torch thread per rank, load average {result['load_before']:.2f} before "
                        "the run") + f"; model `{cfg['model']}`, {cfg['prompt_len']}-token prompts, "
             f"{cfg['output_len']} greedy output tokens each. Same tokens in every layout: "
             f"**{result['same_tokens']}**.", "",
             "| TP | PP | requests | output tok/s | mean TTFT ms | vs 1 rank | busy per stage |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in result["rows"]
            if r["tensor_parallel_size"] == r["pipeline_parallel_size"] == 1}
    for r in result["rows"]:
        busy = result["busy"].get(str(r["concurrency"])) if r["pipeline_parallel_size"] > 1 else None
        busy_text = " / ".join(f"{b:.0%}" for b in busy) if busy else ""
        lines.append(f"| {r['tensor_parallel_size']} | {r['pipeline_parallel_size']} | {r['concurrency']} | "
                     f"{r['output_tokens_per_s']:.0f} | {1000 * r['ttft_s']:.0f} | "
                     f"{r['output_tokens_per_s'] / base[r['concurrency']]:.2f}x | {busy_text} |")
    lines += ["", "Busy per stage: the share of the round's wall time each stage spent computing (its waits to "
              "receive hidden states and to hand them over excluded)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "pipeline_parallel", plot=True)
    ap.add_argument("--model", default="small", help="tiny, small (default), default, or a checkpoint dir")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args(argv)
    model = resolve_model(args.model)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    prompts = [[(7 * i + j) % 500 + 3 for j in range(args.prompt_len)] for i in range(max(args.concurrency))]
    torch.set_num_threads(1)  # one rank computes in this process
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers of a split model read it
    rows, busy, timelines = [], {}, {}
    for tp, pp in LAYOUTS:
        layout_rows, layout_timelines = measure(model, tp, pp, prompts, args.concurrency, args.output_len)
        rows += layout_rows
        if layout_timelines:
            timelines = layout_timelines
            for row in layout_rows:
                ranks = layout_timelines[row["concurrency"]]
                begin = min(a for t in ranks for a, _ in t)
                end = max(b for t in ranks for _, b in t)
                busy[str(row["concurrency"])] = [busy_fraction(t, begin, end) for t in ranks]
    same = all(r["tokens"] == next(q for q in rows if q["concurrency"] == r["concurrency"])["tokens"] for r in rows)
    for r in rows:
        del r["tokens"]
    result = {**run_info("benchmarks.pipeline_parallel", argv), "runtime_s": time.perf_counter() - start,
              "load_before": load_before,
              "config": {"model": args.model, "prompt_len": args.prompt_len, "output_len": args.output_len,
                         "concurrency": args.concurrency},
              "same_tokens": same, "rows": rows, "busy": busy}
    plot(timelines, args.plot)
    write_results("pipeline_parallel", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
