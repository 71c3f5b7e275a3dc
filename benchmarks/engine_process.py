"""The server with its engine core in-process against the engine core in its own process.

Both modes of ``stagedserve serve`` (``--no-engine-process`` / ``--engine-process``) serve
the same seeded workload, each started as its own process and driven by ``stagedserve
bench serve``'s load generator (streaming completions, everything sent at once, held to
``--concurrency`` requests in flight). The two modes run back to back, in alternating
order, ``--repeats`` times; the table shows the median of each number over the repeats,
with the server's own attribution of the first token (``server_timeline``: front end in,
queue, prefill, front end out).

    python -m benchmarks.engine_process [--models tiny small --concurrency 64 --repeats 3]
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from benchmarks.server_vs_offline import process_cpu_seconds, served_in_subprocess
from shared import resolve_model
from stage5_server.bench.datasets import DatasetConfig
from stage5_server.bench.goodput import SLO
from stage5_server.bench.report import summarize_run
from stage5_server.bench.serve import ServeConfig, run_serve


def process_tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of a process and its direct children (the engine-core process), from ``/proc``."""
    total = process_cpu_seconds(pid)
    if total is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return total + sum(process_cpu_seconds(int(child)) or 0.0 for child in children)


MODES = {"in-process": "--no-engine-process", "engine process": "--engine-process"}


def run_mode(model: str, mode: str, num_prompts: int, concurrency: int, slo: SLO, request_rate: float = math.inf,
             seed: int = 0) -> dict:
    dataset = DatasetConfig(name="random", num_prompts=num_prompts, seed=seed, prompt_len=48, output_len=48,
                            len_sigma=0.6, max_prompt_len=192, max_output_len=192)
    engine_kwargs = dict(max_model_len=512, max_num_seqs=concurrency, max_num_batched_tokens=512, device="cpu",
                         seed=0)
    with served_in_subprocess(model, engine_kwargs, extra_args=(MODES[mode],)) as (url, api_key, pid):
        config = ServeConfig(base_url=url, api_key=api_key, model="bench", max_concurrency=concurrency,
                             request_rate=request_rate, warmup_requests=4, dataset=dataset, seed=seed, slo=slo)
        cpu_before, tree_before = process_cpu_seconds(pid), process_tree_cpu_seconds(pid)
        res = summarize_run(run_serve(config))
        server_cpu_s = process_cpu_seconds(pid) - cpu_before if cpu_before is not None else None
        tree_after = process_tree_cpu_seconds(pid)
        tree_cpu_s = tree_after - tree_before if tree_before is not None and tree_after is not None else None
    tokens = res["total_output_tokens"]
    phases = res["server_phases_ms"]
    return {"mode": mode, "completed": res["counts"]["completed"], "failed": res["counts"]["failed"],
            "output_tok_s": res["output_token_throughput_tok_s"], "goodput_req_s": res["goodput_req_s"],
            "request_throughput_req_s": res["request_throughput_req_s"],
            "ttft_p50_ms": res["ttft_ms"]["p50"], "ttft_p99_ms": res["ttft_ms"]["p99"],
            "itl_p50_ms": res["itl_ms"]["p50"], "itl_p99_ms": res["itl_ms"]["p99"],
            "api_server_cpu_ms_per_token": 1e3 * server_cpu_s / tokens if server_cpu_s is not None and tokens else None,
            "all_processes_cpu_ms_per_token": 1e3 * tree_cpu_s / tokens if tree_cpu_s is not None and tokens else None,
            "server_phases_p50_ms": {name: s["p50"] for name, s in phases.items()},
            "server_phases_p99_ms": {name: s["p99"] for name, s in phases.items()}}


def run_model(model: str, num_prompts: int, concurrency: int, repeats: int, slo: SLO,
              request_rate: float = math.inf) -> dict:
    runs = []
    for repeat in range(repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        for mode in order:
            result = run_mode(model, mode, num_prompts, concurrency, slo, request_rate)
            print(f"{Path(model).name} repeat {repeat} {mode}: {result['output_tok_s']:.0f} tok/s, "
                  f"TTFT p99 {result['ttft_p99_ms']:.0f} ms, ITL p99 {result['itl_p99_ms']:.1f} ms", flush=True)
            runs.append({"repeat": repeat, **result})
    medians = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        medians[mode] = {key: statistics.median(r[key] for r in mine)
                         for key in ("output_tok_s", "goodput_req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                     "itl_p99_ms")}
        for key in ("api_server_cpu_ms_per_token", "all_processes_cpu_ms_per_token"):
            values = [r[key] for r in mine if r[key] is not None]
            medians[mode][key] = statistics.median(values) if values else None
        for key in ("server_phases_p50_ms", "server_phases_p99_ms"):
            medians[mode][key] = {name: statistics.median(r[key][name] for r in mine) for name in mine[0][key]}
    return {"model": Path(model).name, "runs": runs, "medians": medians}


def arrivals(request_rate: str) -> str:
    rate = float(request_rate)
    return "all sent at once" if math.isinf(rate) else f"Poisson arrivals at {rate:g} requests/s"


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "### Engine core in-process vs in its own process",
        "",
        provenance(result, f"{cfg['threads']} torch thread(s) per process") + "; "
        f"{cfg['num_prompts']} streaming requests per run, at most {cfg['concurrency']} in flight, "
        f"{arrivals(cfg.get('request_rate', 'inf'))}, greedy, EOS ignored; "
        f"medians of {cfg['repeats']} runs per mode, modes alternating. Goodput SLO: {cfg['slo']}.",
        "",
        "| model | mode | output tok/s | goodput req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
        "CPU ms/token, API-server process | CPU ms/token, all server processes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(value):
        return "n/a" if value is None else f"{value:.3f}"

    for m in result["models"]:
        for mode, s in m["medians"].items():
            lines.append(f"| `{m['model']}` | {mode} | {s['output_tok_s']:.0f} | {s['goodput_req_s']:.2f} | "
                         f"{s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['itl_p50_ms']:.1f} | "
                         f"{s['itl_p99_ms']:.1f} | {ms(s['api_server_cpu_ms_per_token'])} | "
                         f"{ms(s['all_processes_cpu_ms_per_token'])} |")
    lines += ["", "Where the first token's time went (server-side, median over runs of each run's p50, ms):", "",
              "| model | mode | front end in | queue | prefill | front end out | server TTFT |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for m in result["models"]:
        for mode, s in m["medians"].items():
            p = s["server_phases_p50_ms"]
            lines.append(f"| `{m['model']}` | {mode} | {p['frontend_in']:.1f} | {p['queue']:.1f} | "
                         f"{p['prefill']:.1f} | {p['frontend_out']:.1f} | {p['server_ttft']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "engine_process")
    ap.add_argument("--models", nargs="+", default=["tiny", "small"],
                    help="checkpoint dirs, or 'tiny' / 'small' (random Llamas) / 'default' (the trained default)")
    ap.add_argument("--num-prompts", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server process")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-p99-ms", type=float, default=250.0)
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="Poisson arrivals at this many requests/s (default: all at once, held to --concurrency)")
    ap.add_argument("--name", default="engine_process", help="results file name under --out-dir")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # served_in_subprocess hands this to the servers as OMP_NUM_THREADS
    slo = SLO(ttft_ms=args.slo_ttft_ms, itl_p99_ms=args.slo_itl_p99_ms)
    models = [resolve_model(m) for m in args.models]
    result = {**run_info("benchmarks.engine_process", argv),
              "config": {"num_prompts": args.num_prompts, "concurrency": args.concurrency, "repeats": args.repeats,
                         "threads": args.threads, "slo": slo.describe(), "request_rate": str(args.request_rate)},
              "models": [run_model(m, args.num_prompts, args.concurrency, args.repeats, slo, args.request_rate)
                         for m in models]}
    write_results(args.name, result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
