"""Decode attention on a CPU: the C++ operator against the SDPA path, and against the memory it reads.

A decode step's attention reads every running sequence's keys and values once; a kernel that did
nothing else would take the bytes it reads over the machine's read bandwidth. For the default
model's shapes (9 query heads of 64 over 3 KV heads, blocks of 16), at 1, 16 and 64 decodes with
contexts drawn from 64 to 512 tokens, in bfloat16 and float32, one run measures:

- the C++ operator (``cpu_kernels/csrc/paged_decode.cpp``), reading each sequence's blocks in place;
- the SDPA path the ``cpu`` backend takes where the operator cannot be built (blocks gathered with
  ``index_select``, one padded, masked ``scaled_dot_product_attention`` call);
- the floor: the K/V bytes the step reads over the read bandwidth of a plain sum over a buffer
  larger than the caches, measured in the same run;

each over a pool four times larger than the blocks in use, so the blocks are spread as in a
running server, with a different set of sequences each call so that no call finds the last one's
blocks in cache.

``--profile`` adds the engine on ``cpu_peers``'s batch-64 workload (``LLM()`` defaults) under
``torch.profiler``: the operators that take the most time, and the decode operator's share.

    python -m benchmarks.cpu_decode_attention [--profile]
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from benchmarks.machine_roofline import read_bandwidth
from stage2_paged.attention import PagedAttentionMetadata
from stage5_server.attention.cpu_attn import grouped_paged_attention, plan_groups
from stage5_server.cpu_kernels.paged_decode import load_cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M
SETS = 8  # sequence sets a measurement cycles through


def decode_sets(rows: int, dtype: torch.dtype, seed: int = 0):
    """Caches, queries and SETS step metadatas of ``rows`` decodes each, over one shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    lens = [torch.randint(64, 513, (rows,), generator=gen, dtype=torch.int32) for _ in range(SETS)]
    blocks_needed = [int(((n + BLOCK_SIZE - 1) // BLOCK_SIZE).sum()) for n in lens]
    pool = 4 * sum(blocks_needed)
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    key_cache = torch.randn(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value_cache = torch.randn(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    steps, taken = [], 0
    for n in lens:
        per_seq = ((n + BLOCK_SIZE - 1) // BLOCK_SIZE).tolist()
        tables = torch.zeros(rows, max(per_seq), dtype=torch.int32)
        for i, count in enumerate(per_seq):
            tables[i, :count] = order[taken:taken + count]
            taken += count
        meta = PagedAttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.int64),
                                      query_start_loc=torch.arange(rows + 1, dtype=torch.int32), seq_lens=n,
                                      block_tables=tables, max_query_len=1, max_seq_len=int(n.max()))
        steps.append(meta)
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return key_cache, value_cache, query, steps, lens


def measure(rows: int, dtype: torch.dtype, bandwidth: float, calls: int) -> dict:
    key_cache, value_cache, query, steps, lens = decode_sets(rows, dtype)
    row = {"decodes": rows, "dtype": str(dtype).removeprefix("torch."),
           "mean_context": float(torch.cat(lens).float().mean())}
    bytes_read = [int(n.sum()) * KV_HEADS * HEAD_DIM * 2 * key_cache.element_size() for n in lens]
    row["floor_ms"] = sum(bytes_read) / len(bytes_read) / bandwidth * 1e3
    group = HEADS // KV_HEADS
    for name, in_place in (("operator", True), ("sdpa", False)):
        plans = [plan_groups(meta, BLOCK_SIZE, group, dtype, in_place) for meta in steps]  # once a step
        for plan in plans:
            grouped_paged_attention(query, key_cache, value_cache, plan, HEAD_DIM ** -0.5)
        start = time.perf_counter()
        for i in range(calls):
            grouped_paged_attention(query, key_cache, value_cache, plans[i % SETS], HEAD_DIM ** -0.5)
        row[f"{name}_ms"] = (time.perf_counter() - start) / calls * 1e3
    return row


def profile_engine(top: int) -> dict:
    """The engine on cpu_peers's batch-64 workload under torch.profiler: the top operators by self time."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.cpu_peers import batch_engine, greedy
    from benchmarks.cpu_roofline import make_workload

    prompts, outputs = make_workload(64, 0, 49152)
    llm = batch_engine()
    llm.generate([prompts[0][:16], prompts[0][:8]], greedy(4), use_tqdm=False)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, [greedy(n) for n in outputs], use_tqdm=False)
        seconds = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"seconds": seconds, "output_tokens": sum(outputs), "dtype": str(llm.dtype).removeprefix("torch."),
            "operators": [{"name": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6,
                           "share": e.self_cpu_time_total / total} for e in events[:top]]}


def markdown(result: dict) -> str:
    lines = ["### Decode attention: the C++ operator, the SDPA path and the memory floor", "",
             provenance(result, f"{result['threads']} torch threads, read bandwidth "
                                f"{result['read_gb_s']:.1f} GB/s, load average {result['load_average']}"), "",
             "| dtype | decodes | mean context | operator ms | SDPA path ms | floor ms | SDPA / operator | "
             "operator / floor |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['decodes']} | {r['mean_context']:.0f} | {r['operator_ms']:.3f} | "
                     f"{r['sdpa_ms']:.3f} | {r['floor_ms']:.3f} | {r['sdpa_ms'] / r['operator_ms']:.2f}x | "
                     f"{r['operator_ms'] / r['floor_ms']:.2f}x |")
    if "profile" in result:
        p = result["profile"]
        lines += ["", f"The engine on the batch-64 workload ({p['dtype']}): {p['output_tokens'] / p['seconds']:.0f} "
                      f"output tokens/s under the profiler; the operators with the most self time:", "",
                  "| operator | calls | seconds | share |", "|---|---:|---:|---:|"]
        lines += [f"| `{o['name'][:60]}` | {o['calls']} | {o['self_s']:.2f} | {o['share']:.0%} |"
                  for o in p["operators"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "cpu_decode_attention")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="also profile the engine on the batch-64 workload")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    why = load_cpu_kernels()
    if why is not None:
        raise SystemExit(f"nothing to measure: {why}")
    result = {**run_info("benchmarks.cpu_decode_attention", argv), "threads": torch.get_num_threads()}
    before = os.getloadavg()[0]
    bandwidth = read_bandwidth()
    result["read_gb_s"] = bandwidth / 1e9
    result["rows"] = [measure(rows, dtype, bandwidth, args.calls)
                      for dtype in (torch.bfloat16, torch.float32) for rows in (1, 16, 64)]
    if args.profile:
        result["profile"] = profile_engine(args.top)
    result["load_average"] = f"{before:.2f} before, {os.getloadavg()[0]:.2f} after"
    write_results("cpu_decode_attention", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
