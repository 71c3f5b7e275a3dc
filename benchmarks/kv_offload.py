"""The KV offload tier on a multi-turn chat whose conversations do not fit the pool together.

Each of ``--conversations`` conversations runs ``--turns`` turns: a turn's prompt is the whole conversation so
far (earlier prompts and answers) plus ``--user-len`` new tokens, answered with ``--output-len`` tokens
(greedy, EOS ignored). All conversations take their turn t together (one ``generate`` call), then turn
t + 1. The pool holds ``--pool-fraction`` of the K/V the conversations reach at their last turn, so by the
time a conversation comes back, the pool's LRU has evicted most of its prefix. The same workload runs on
the same engine settings without and with ``--kv-offloading-size``, alternating, ``--repeats`` times each:
prefix hit rate (tokens found / looked up), where the hits came from, prefill tokens computed, TTFT p50/p99
per request, wall time; the greedy tokens must be the same with and without.

    python -m benchmarks.kv_offload [--model default --conversations 32 --turns 6 --pool-fraction 0.25]
"""

from __future__ import annotations

import random
import statistics
import time

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from course import cached_tiny_model
from shared import SamplingParams, summarize

NAME = "kv_offload"


def run_workload(model: str, offload_gib: float | None, args, num_kv_blocks: int) -> dict:
    from stage5_server import LLM

    extra = {} if offload_gib is None else {"kv_offloading_size": offload_gib}
    llm = LLM(model=model, block_size=args.block_size, num_kv_blocks=num_kv_blocks, max_model_len=args.max_model_len,
              max_num_seqs=args.conversations, max_num_batched_tokens=args.max_num_batched_tokens,
              dtype=args.dtype, seed=0, log_stats_interval=None, **extra)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # warm up
    rng = random.Random(args.seed)
    histories = [[] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    before, ttfts, outputs, prompt_tokens = llm.engine.stats(), [], [], 0
    start = time.perf_counter()
    for _ in range(args.turns):
        for history in histories:
            history += [rng.randrange(100, args.vocab) for _ in range(args.user_len)]
        prompt_tokens += sum(len(h) for h in histories)
        results = llm.generate([list(h) for h in histories], params, use_tqdm=False)
        for history, result in zip(histories, results):
            tokens = list(result.outputs[0].token_ids)
            history += tokens
            outputs.append(tokens)
            ttfts.append(result.timeline.ttft)
    wall = time.perf_counter() - start
    after = llm.engine.stats()
    llm.engine.shutdown()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    host = after.kv_connector.host_hit_tokens - before.kv_connector.host_hit_tokens
    ttft = summarize([t for t in ttfts if t is not None])
    computed = after.num_prompt_tokens_computed - before.num_prompt_tokens_computed
    return {"wall_s": wall, "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits,
            "prompt_tokens": prompt_tokens, "reused": 1 - computed / prompt_tokens,
            "host_hit_tokens": host, "device_hit_tokens": hits - host,
            "prefill_tokens_computed": computed,
            "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
            "tier_evicted_blocks": after.kv_connector.offload_evicted_blocks,
            "tier_capacity_blocks": after.kv_connector.offload_capacity_blocks, "outputs": outputs}


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, NAME)
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny, or a checkpoint path")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--offload-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model == "tiny":
        model, args.vocab = str(cached_tiny_model("llama")), 256
    else:
        from shared.named_models import default_model

        model, args.vocab = default_model() if args.model == "default" else args.model, 8000
    final_len = args.turns * (args.user_len + args.output_len)
    args.max_model_len = final_len + args.block_size
    total_blocks = args.conversations * -(-final_len // args.block_size)
    num_kv_blocks = max(int(total_blocks * args.pool_fraction), -(-args.max_model_len // args.block_size) + 1)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both alike
        runs["off"].append(run_workload(model, None, args, num_kv_blocks))
        runs["on"].append(run_workload(model, args.offload_gib, args, num_kv_blocks))
    reference = runs["off"][0]["outputs"]
    same = {name: sum(a == b for run in variant for a, b in zip(run["outputs"], reference)) / len(variant)
            for name, variant in runs.items()}  # outputs equal to the first run's without the tier, per run
    summary = {name: {key: statistics.median(run[key] for run in variant) for key in variant[0] if key != "outputs"}
               for name, variant in runs.items()}
    result = {**run_info(f"benchmarks.{NAME}", argv), "model": args.model, "dtype": args.dtype,
              "num_kv_blocks": num_kv_blocks, "total_blocks": total_blocks, "outputs_equal_to_first": same,
              "settings": {k: v for k, v in vars(args).items() if k not in ("out_dir", "markdown")},
              "summary": summary}
    rows = [("prompt tokens not recomputed", "reused", "{:.1%}"),
            ("prefix hit rate (per lookup, as vLLM counts it)", "hit_rate", "{:.1%}"),
            ("hit tokens from the pool", "device_hit_tokens", "{:,.0f}"),
            ("hit tokens from the tier", "host_hit_tokens", "{:,.0f}"),
            ("prefill tokens computed", "prefill_tokens_computed", "{:,.0f}"),
            ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"), ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"),
            ("wall (s)", "wall_s", "{:.1f}")]
    off, on = summary["off"], summary["on"]
    runs_text = f"medians of {args.repeats} alternating runs" if args.repeats > 1 else "one run each"
    lines = [provenance(result, f"{args.model} model, dtype {args.dtype}, {runs_text}"),
             "", f"{args.conversations} conversations x {args.turns} turns ({args.user_len} new tokens and "
             f"{args.output_len} answered per turn); a pool of {num_kv_blocks} blocks of {args.block_size} tokens, "
             f"{num_kv_blocks / total_blocks:.0%} of the {total_blocks} the conversations reach; tier "
             f"{args.offload_gib} GiB ({on['tier_capacity_blocks']:.0f} blocks).", "",
             "| | without the tier | with `--kv-offloading-size` |", "|---|---:|---:|"]
    lines += [f"| {label} | {fmt.format(off[key])} | {fmt.format(on[key])} |" for label, key, fmt in rows]
    lines += ["", f"Greedy outputs equal to the first run without the tier: {same['off']:.0f} of {len(reference)} "
              f"without the tier, {same['on']:.0f} of {len(reference)} with it (a mean over the runs).", ""]
    write_results(NAME, result, "\n".join(lines), args.out_dir, args.markdown)


if __name__ == "__main__":
    main()
