"""Prefix caching on the two-phase load: prefill tokens computed, hit rate, TTFT per phase.

Phase 1: a burst of short requests behind one long shared system prompt; phase 2: two very
long prompts alongside more short ones (``course.workloads.two_phase_load``). Each phase is
one offline ``generate`` call on the same engine (so phase 2 can reuse what phase 1 cached),
run through stage3 (no caching), stage4 with caching off, and stage4 with caching on.
Checks the arithmetic: prefill tokens saved == the sum of every request's ``num_cached_tokens``.

    python -m benchmarks.prefix_cache [--system-prompt-len 384 --long-prompt-len 1024 --seed 0]
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, save_figure, write_results
from course import cached_tiny_model
from course.workloads import two_phase_load
from shared import SamplingParams, summarize
from shared.config import ModelConfig

ENGINES = {
    "stage3": ("stage3_continuous", {}),
    "stage4_cache_off": ("stage4_prefix_cache", {"enable_prefix_caching": False}),
    "stage4_cache_on": ("stage4_prefix_cache", {"enable_prefix_caching": True}),
}


def run_engine(name: str, model: str, load, block_size: int, max_num_batched_tokens: int, max_model_len: int,
               num_kv_blocks: int, max_num_seqs: int) -> dict:
    package, extra = ENGINES[name]
    llm = importlib.import_module(package).LLM(model=model, block_size=block_size, num_kv_blocks=num_kv_blocks,
                                               max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens, seed=0, **extra)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)  # warm up
    phases = {}
    for phase in sorted({r.phase for r in load}):
        reqs = [r for r in load if r.phase == phase]
        before = llm.engine.stats()
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        start = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.engine.stats()
        ttft = summarize([o.timeline.ttft for o in outs if o.timeline.ttft is not None])
        short_ttft = summarize([o.timeline.ttft for o, r in zip(outs, reqs) if r.kind == "short"])
        phases[f"phase{phase}"] = {
            "num_requests": len(reqs), "prompt_tokens": sum(r.prompt_len for r in reqs), "wall_s": wall,
            "prefill_tokens_computed": after.num_prompt_tokens_computed - before.num_prompt_tokens_computed,
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
            "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
            "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
            "short_ttft_p50_s": short_ttft["p50"], "short_ttft_p99_s": short_ttft["p99"],
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
        }
    total = {k: sum(p[k] for p in phases.values())  # the warm-up request is left out
             for k in ("prefill_tokens_computed", "cached_tokens", "prefix_cache_queries", "prefix_cache_hits")}
    queries = total["prefix_cache_queries"]
    total["hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
    total["num_preemptions"] = llm.engine.stats().num_preemptions
    return {"engine": name, "phases": phases, "total": total}


def run(model: str | None = None, seed: int = 0, system_prompt_len: int = 384, long_prompt_len: int = 1024,
        num_short_phase1: int = 12, num_short_phase2: int = 8, max_tokens: int = 8, block_size: int = 16,
        max_num_batched_tokens: int = 512, max_num_seqs: int = 16, num_kv_blocks: int | None = None) -> dict:
    model = str(model or cached_tiny_model("llama"))
    vocab = ModelConfig.from_pretrained(model).vocab_size
    load = two_phase_load(vocab, seed, system_prompt_len=system_prompt_len, long_prompt_len=long_prompt_len,
                          num_short_phase1=num_short_phase1, num_short_phase2=num_short_phase2,
                          short_max_tokens=max_tokens, long_max_tokens=max_tokens)
    max_model_len = max(r.prompt_len for r in load) + max_tokens + block_size
    if num_kv_blocks is None:  # enough for every request at once: no preemption muddles the counts
        num_kv_blocks = sum(-(-(r.prompt_len + max_tokens) // block_size) for r in load) + 4
    rows = [run_engine(name, model, load, block_size, max_num_batched_tokens, max_model_len, num_kv_blocks,
                       max_num_seqs) for name in ENGINES]
    by = {r["engine"]: r for r in rows}
    off, on = by["stage4_cache_off"], by["stage4_cache_on"]
    checks = {}
    for ph in off["phases"]:
        saved = off["phases"][ph]["prefill_tokens_computed"] - on["phases"][ph]["prefill_tokens_computed"]
        checks[ph] = {"prefill_tokens_saved": saved, "sum_num_cached_tokens": on["phases"][ph]["cached_tokens"],
                      "saved_equals_cached": saved == on["phases"][ph]["cached_tokens"]}
    saved = off["total"]["prefill_tokens_computed"] - on["total"]["prefill_tokens_computed"]
    checks["total"] = {"prefill_tokens_saved": saved, "sum_num_cached_tokens": on["total"]["cached_tokens"],
                       "saved_equals_cached": saved == on["total"]["cached_tokens"],
                       "saved_fraction": saved / off["total"]["prefill_tokens_computed"]}
    checks["stage3_equals_stage4_cache_off"] = (by["stage3"]["total"]["prefill_tokens_computed"]
                                                == off["total"]["prefill_tokens_computed"])
    same = all(r["phases"][ph]["output_token_ids"] == off["phases"][ph]["output_token_ids"]
               for r in rows for ph in off["phases"])
    checks["same_outputs_all_engines"] = same
    # Block-rounded expectation for the short requests: every short prompt after the first can reuse
    # floor(system_prompt_len / block_size) blocks, if the first one's blocks were cached by then.
    checks["block_rounded_shared_tokens_per_short_request"] = (system_prompt_len // block_size) * block_size
    for r in rows:
        for p in r["phases"].values():
            p.pop("output_token_ids")
    assert checks["total"]["saved_equals_cached"], f"prefill tokens saved != sum of num_cached_tokens: {checks}"
    return {
        "config": {"model": Path(model).name, "seed": seed, "system_prompt_len": system_prompt_len,
                   "long_prompt_len": long_prompt_len, "num_short_phase1": num_short_phase1,
                   "num_short_phase2": num_short_phase2, "max_tokens": max_tokens, "block_size": block_size,
                   "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                   "num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len,
                   "prompt_tokens": sum(r.prompt_len for r in load)},
        "engines": rows,
        "checks": checks,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["engines"]
    names = [r["engine"] for r in rows]
    phases = list(rows[0]["phases"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(phases)
    colors = ["#2a9d8f", "#e76f51", "#264653"]
    for k, ph in enumerate(phases):
        xs = [i + (k - (len(phases) - 1) / 2) * width for i in range(len(rows))]
        ax1.bar(xs, [r["phases"][ph]["prefill_tokens_computed"] for r in rows], width=width, label=ph,
                color=colors[k % 3])
        ax2.bar(xs, [r["phases"][ph]["ttft_p50_s"] * 1e3 for r in rows], width=width, label=f"{ph} p50",
                color=colors[k % 3])
        ax2.scatter(xs, [r["phases"][ph]["ttft_p99_s"] * 1e3 for r in rows], marker="_", s=200, color="black",
                    label="p99" if k == 0 else None)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(rows)), names, fontsize=8)
        ax.legend(fontsize=8)
    ax1.set_ylabel("prefill tokens computed")
    ax1.set_title(f"prefill work (saved with caching: {100 * result['checks']['total']['saved_fraction']:.0f}%)")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title("TTFT per phase")
    save_figure(fig, path)


def markdown(result: dict) -> str:
    c, ch = result["config"], result["checks"]
    lines = [
        "### Prefix caching on the two-phase load",
        "",
        provenance(result, f"{c.get('torch_threads', '?')} torch thread(s), CPU float32; "
                           f"runtime {result['runtime_s']:.0f} s") + ".",
        "",
        f"Model `{c['model']}`. Phase 1: {c['num_short_phase1']} short requests behind one {c['system_prompt_len']}"
        f"-token system prompt. Phase 2: 2 prompts of {c['long_prompt_len']} tokens alongside "
        f"{c['num_short_phase2']} more short ones behind the same system prompt. {c['max_tokens']} output tokens "
        f"each, greedy; block size {c['block_size']}, max_num_batched_tokens {c['max_num_batched_tokens']}, "
        f"{c['num_kv_blocks']} KV blocks (no preemption). Each phase is one `generate` call on the same engine.",
        "",
        "| engine | phase | prompt tokens | prefill computed | cached tokens | hit rate | TTFT p50 ms | "
        "TTFT p99 ms | short-request TTFT p50 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["engines"]:
        for ph, p in r["phases"].items():
            rate = p["prefix_cache_hits"] / p["prefix_cache_queries"] if p["prefix_cache_queries"] else 0.0
            lines.append(f"| {r['engine']} | {ph} | {p['prompt_tokens']} | {p['prefill_tokens_computed']} | "
                         f"{p['cached_tokens']} | {100 * rate:.0f}% | {p['ttft_p50_s'] * 1e3:.0f} | "
                         f"{p['ttft_p99_s'] * 1e3:.0f} | {p['short_ttft_p50_s'] * 1e3:.0f} |")
    t = ch["total"]
    lines += [
        "",
        f"- Prefill tokens saved by caching: {t['prefill_tokens_saved']} of "
        f"{t['prefill_tokens_saved'] + result['engines'][2]['total']['prefill_tokens_computed']} "
        f"({100 * t['saved_fraction']:.1f}%); sum of `num_cached_tokens`: {t['sum_num_cached_tokens']} "
        f"({'equal' if t['saved_equals_cached'] else 'NOT equal'}).",
        f"- Block-rounded shareable system prompt per short request: "
        f"{ch['block_rounded_shared_tokens_per_short_request']} of {c['system_prompt_len']} tokens.",
        f"- stage3 and stage4 with caching off compute the same prefill: {ch['stage3_equals_stage4_cache_off']}; "
        f"identical output tokens across all three: {ch['same_outputs_all_engines']}.",
        "",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "prefix_cache", plot=True)
    ap.add_argument("--model", default=None, help="checkpoint directory; default: the tiny llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-prompt-len", type=int, default=384)
    ap.add_argument("--long-prompt-len", type=int, default=1024)
    ap.add_argument("--num-short-phase1", type=int, default=12)
    ap.add_argument("--num-short-phase2", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = {**run_info("benchmarks.prefix_cache", argv),
              **run(args.model, args.seed, args.system_prompt_len, args.long_prompt_len, args.num_short_phase1,
                    args.num_short_phase2, args.max_tokens, args.block_size, args.max_num_batched_tokens)}
    result["runtime_s"] = round(time.perf_counter() - start, 3)
    result["config"]["torch_threads"] = args.threads
    plot(result, Path(args.plot))
    write_results("prefix_cache", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
