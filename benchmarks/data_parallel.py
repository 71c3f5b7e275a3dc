"""One engine core against two (data parallelism), and least-loaded against prefix-affinity routing.

Each configuration of ``stagedserve serve`` runs as its own process tree and serves the same
seeded workload, driven by ``stagedserve bench serve``'s load generator: the ``shared-prefix``
dataset with ``--num-prefixes`` distinct prefixes (system prompts), streaming, greedy, EOS
ignored, at most ``--concurrency`` requests in flight. Every rank has the same KV pool
(``--num-kv-blocks``), as each GPU of a real data-parallel deployment has its own memory; the
pool is sized so that one rank cannot hold every prefix at once, but half of them.

Every server process runs ``--threads`` torch threads (default 1, as in ``engine_process``;
0 lets ``stagedserve serve`` split the cores, ``cores / DP`` a rank). On a machine with two
cores, two engine cores take both where one takes one, and the API servers, the coordinator
and the load generator compete for the same two: this is a check that the topology serves
correctly and what it costs, not a speed claim for data parallelism, whose point is more GPUs. The table
shows, per configuration: throughput, TTFT, the prefix-cache hit rate (hit / queried prompt
tokens, from ``/metrics`` over all ranks), each rank's share of the generated tokens, whether
every output equals the DP = 1 run's, and the process tree counted against the seeds' formula.

    python -m benchmarks.data_parallel [--num-prompts 192 --num-prefixes 8 --repeats 3]
"""

from __future__ import annotations

import statistics
from pathlib import Path

import httpx

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from benchmarks.server_vs_offline import process_cpu_seconds, served_in_subprocess
from shared import resolve_model
from stage5_server.bench.datasets import DatasetConfig
from stage5_server.bench.goodput import SLO
from stage5_server.bench.report import summarize_run
from stage5_server.bench.serve import ServeConfig, run_serve
from stage5_server.cli.serve import serving_process_count

CONFIGS = {  # name -> (A, DP, routing)
    "DP=1": (1, 1, "least-loaded"),
    "DP=2, A=1, least-loaded": (1, 2, "least-loaded"),
    "DP=2, A=2, least-loaded": (2, 2, "least-loaded"),
    "DP=2, A=2, prefix-affinity": (2, 2, "prefix-affinity"),
}
ROLES = (("ss-supervisor", "supervisor"), ("ss-coordinator", "coordinator"), ("ss-engine", "engine_cores"),
         ("ss-tp", "workers"), ("ss-api", "api_servers"))


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, from ``/proc``."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return tree


def process_roles(pid: int) -> dict[str, int]:
    """The serving processes of the tree by role (their names; the serve process itself is the API server
    when A = 1; multiprocessing's resource tracker is left out)."""
    counts = {role: 0 for _, role in ROLES}
    for p in process_tree(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "resource_tracker" not in cmdline:
            counts[next((role for prefix, role in ROLES if name.startswith(prefix)), "api_servers")] += 1
    counts["total"] = sum(counts.values())
    return counts


def engine_counters(url: str, api_key: str) -> dict[str, dict[str, float]]:
    """Per rank: prefix-cache queries and hits, generated tokens (``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                               "vllm:generation_tokens_total"):
                out.setdefault(sample.labels["engine"], {})[sample.name.split(":")[1]] = sample.value
    return out


def run_config(model: str, name: str, args, slo: SLO) -> dict:
    api_servers, dp, routing = CONFIGS[name]
    engine_kwargs = dict(max_model_len=512, max_num_seqs=args.concurrency, max_num_batched_tokens=512, device="cpu",
                         seed=0)
    flags = ("--data-parallel-size", str(dp), "--api-server-count", str(api_servers), "--dp-routing", routing,
             "--num-kv-blocks", str(args.num_kv_blocks), "--block-size", "16")
    dataset = DatasetConfig(name="shared-prefix", num_prompts=args.num_prompts, seed=0, prefix_len=args.prefix_len,
                            num_prefixes=args.num_prefixes)
    with served_in_subprocess(model, engine_kwargs, timeout_s=600, extra_args=flags, prefix_caching=True,
                              omp_threads=args.threads or None) as (url, api_key, pid):
        roles = process_roles(pid)
        config = ServeConfig(base_url=url, api_key=api_key, model="bench", max_concurrency=args.concurrency,
                             dataset=dataset, seed=0, slo=slo)
        tree = process_tree(pid)
        cpu_before = sum(process_cpu_seconds(p) or 0.0 for p in tree)
        run = run_serve(config)
        cpu_s = sum(process_cpu_seconds(p) or 0.0 for p in process_tree(pid)) - cpu_before
        counters = engine_counters(url, api_key)
    res = summarize_run(run)
    queries = sum(c.get("prefix_cache_queries_total", 0) for c in counters.values())
    hits = sum(c.get("prefix_cache_hits_total", 0) for c in counters.values())
    generated = {rank: c.get("generation_tokens_total", 0) for rank, c in sorted(counters.items())}
    total_generated = sum(generated.values()) or 1
    return {"config": name, "api_servers": api_servers, "data_parallel_size": dp, "routing": routing,
            "completed": res["counts"]["completed"], "failed": res["counts"]["failed"],
            "output_tok_s": res["output_token_throughput_tok_s"], "ttft_p50_ms": res["ttft_ms"]["p50"],
            "ttft_p99_ms": res["ttft_ms"]["p99"], "itl_p50_ms": res["itl_ms"]["p50"],
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "rank_token_share": {rank: n / total_generated for rank, n in generated.items()},
            "cpu_ms_per_token": 1e3 * cpu_s / res["total_output_tokens"] if res["total_output_tokens"] else None,
            "processes": roles, "formula": serving_process_count(api_servers, dp, 1),
            "texts": [r.text for r in sorted(run.records, key=lambda r: r.index) if not r.warmup]}


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "### One engine core against two, least-loaded against prefix-affinity routing",
        "",
        provenance(result, f"{cfg['threads'] or 'cores / DP'} torch thread(s) per engine core, load average "
                           f"{cfg['load_average']} before the runs") + "; "
        f"{cfg['num_prompts']} streaming requests over {cfg['num_prefixes']} shared prefixes of {cfg['prefix_len']} "
        f"tokens (8-32 token suffixes, 32 output tokens), at most {cfg['concurrency']} in flight, greedy; "
        f"{cfg['num_kv_blocks']} KV blocks of 16 tokens per rank; medians of {cfg['repeats']} runs, configurations "
        "alternating. Two cores in all, shared with the load generator: this checks correctness and cost, not "
        "speed.",
        "",
        "| configuration | output tok/s | TTFT p50 ms | TTFT p99 ms | prefix-cache hit rate | tokens per rank | "
        "same outputs as DP=1 | CPU ms/token | processes (formula) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for name, s in result["medians"].items():
        share = " / ".join(f"{100 * v:.0f}%" for v in s["rank_token_share"].values())
        procs = s["processes"]
        tree = (f"{procs['total']}: {procs['api_servers']} API + {procs['engine_cores']} engine"
                f"{' + 1 coordinator' if procs['coordinator'] else ''}"
                f"{' + 1 supervisor' if procs['supervisor'] else ''} "
                f"({'=' if procs == s['formula'] else 'NOT'} the formula's)")
        lines.append(f"| {name} | {s['output_tok_s']:.0f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | "
                     f"{s['prefix_cache_hit_rate']:.2f} | {share} | {s['identical_to_dp1']:.2f} | "
                     f"{s['cpu_ms_per_token']:.2f} | {tree} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    import os

    ap = benchmark_parser(__doc__, "data_parallel")
    ap.add_argument("--model", default="tiny", help="checkpoint dir, or 'tiny' / 'small' / 'default'")
    ap.add_argument("--num-prompts", type=int, default=192)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=192)
    ap.add_argument("--num-kv-blocks", type=int, default=80, help="per rank")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every server process (0: the server splits the cores itself)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args(argv)
    load_average = " ".join(f"{x:.1f}" for x in os.getloadavg())  # before the runs: was the machine quiet?
    slo = SLO(ttft_ms=2000.0, itl_p99_ms=250.0)
    model = resolve_model(args.model)
    runs = []
    for repeat in range(args.repeats):
        order = args.configs if repeat % 2 == 0 else list(reversed(args.configs))
        for name in order:
            r = run_config(model, name, args, slo)
            print(f"repeat {repeat} {name}: {r['output_tok_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                  f"hit rate {r['prefix_cache_hit_rate']:.2f}, processes {r['processes']['total']}", flush=True)
            runs.append({"repeat": repeat, **r})
    reference = next(r["texts"] for r in runs if r["config"] == args.configs[0])
    medians = {}
    for name in args.configs:
        mine = [r for r in runs if r["config"] == name]
        medians[name] = {key: statistics.median(r[key] for r in mine)
                         for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                     "prefix_cache_hit_rate", "cpu_ms_per_token")}
        medians[name]["rank_token_share"] = {rank: statistics.median(r["rank_token_share"][rank] for r in mine)
                                             for rank in mine[0]["rank_token_share"]}
        medians[name]["identical_to_dp1"] = statistics.median(
            sum(a == b for a, b in zip(r["texts"], reference)) / len(reference) for r in mine)
        medians[name]["processes"], medians[name]["formula"] = mine[0]["processes"], mine[0]["formula"]
        medians[name]["failed"] = sum(r["failed"] for r in mine)
    for r in runs:
        del r["texts"]
    result = {**run_info("benchmarks.data_parallel", argv),
              "config": {"model": Path(model).name, "num_prompts": args.num_prompts, "num_prefixes": args.num_prefixes,
                         "prefix_len": args.prefix_len, "num_kv_blocks": args.num_kv_blocks,
                         "concurrency": args.concurrency, "repeats": args.repeats, "threads": args.threads,
                         "load_average": load_average},
              "runs": runs, "medians": medians}
    write_results("data_parallel", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
