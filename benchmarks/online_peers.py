"""``stagedserve serve`` against vLLM's CPU server on the same weights, as deployed: each on its defaults, one
after the other, under the same load at rising request rates.

The load: chat requests (``--backend openai-chat``) of random 256-token prompts, 128 output tokens each (EOS
ignored), 64 at each rate, arriving as a Poisson process at 1, 2, 4 and 8 requests/s in turn (a few warm-up
requests first, not counted); goodput counts the requests that meet both a 2 s TTFT and a 100 ms TPOT. Both
servers serve the default model as a bfloat16 Hugging Face directory (``bf16_checkpoint``: the directory its
GGUF file converts to, saved in bfloat16), on all the CPUs, with an API key; vLLM with
``VLLM_CPU_OMP_THREADS_BIND=nobind`` and a 4 GiB KV cache. The load comes from vLLM's own ``bench serve``,
run from vLLM's virtual environment as ``benchmarks/load_clients.py`` runs it; without vLLM
(``--vllm-python ''``), stagedserve's own ``bench serve`` drives stagedserve alone (the smoke test's way).

    STAGEDSERVE_VLLM_PYTHON=<vllm venv>/bin/python python -m benchmarks.online_peers

stagedserve compiles its compiled step before it listens (``--no-compile-in-background``), as vLLM's server
compiles before it listens, so that no rate is measured while a compiler shares the CPUs.

``--model gguf`` serves stagedserve the GGUF file instead (its default model, vLLM keeps the directory);
``--model gguf --rates 1.5 --num-prompts 48 --slo-tpot-ms 150`` is the single-rate run of earlier versions.

Writes ``benchmarks/results/online_peers.json``, ``docs/results/online_peers.md`` and
``docs/assets/online_peers.png`` (goodput and TPOT p50 against the rate, both servers); with ``--model gguf``,
the same names ending in ``_gguf``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.api_oracle import free_port, server
from benchmarks.common import benchmark_parser, bf16_checkpoint, provenance, run_info, save_figure, write_results
from benchmarks.load_clients import BENCH, shown

NAME = "online_peers"
SERVED_NAME = "smollm2"
STAGEDSERVE, VLLM = "stagedserve serve", "vLLM's CPU server"
COLUMNS = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
           ("req/s", "request_throughput", "{:.2f}"), ("goodput req/s", "request_goodput", "{:.2f}"),
           ("TTFT p50 ms", "median_ttft_ms", "{:.0f}"), ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
           ("TPOT p50 ms", "median_tpot_ms", "{:.0f}"), ("TPOT p99 ms", "p99_tpot_ms", "{:.0f}")]
WARMUP_PROMPTS = 4


def load_args(url: str, key: str, tokenizer: str, args, rate: float, num_prompts: int) -> list[str]:
    return ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", SERVED_NAME, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", "0",
            "--ignore-eos", "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--header", f"Authorization=Bearer {key}"]


def vllm_bench(url: str, key: str, tokenizer: str, args, rate: float, num_prompts: int) -> dict:
    """vLLM's ``bench serve`` at ``rate``: its saved metrics (lists of per-request values left out)."""
    with tempfile.TemporaryDirectory() as result_dir:
        save = ["--save-result", "--result-dir", result_dir, "--result-filename", "run.json"]
        done = subprocess.run([args.vllm_python, "-c", BENCH, *load_args(url, key, tokenizer, args, rate, num_prompts),
                               *save], capture_output=True, text=True, env={**os.environ, "OPENAI_API_KEY": key})
        if done.returncode != 0:
            raise RuntimeError(f"bench serve failed: {done.stderr.strip().splitlines()[-1:]}")
        metrics = json.loads((Path(result_dir) / "run.json").read_text())
    return {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}


def own_bench(url: str, key: str, tokenizer: str, args, rate: float, num_prompts: int) -> dict:
    """stagedserve's ``bench serve`` at ``rate``, its numbers under vLLM's names (token-id prompts on
    ``/v1/completions``: no chat template, so a prompt is exactly ``input_len`` tokens)."""
    from stage5_server.bench.datasets import DatasetConfig
    from stage5_server.bench.goodput import SLO
    from stage5_server.bench.report import summarize_run
    from stage5_server.bench.serve import ServeConfig, run_serve

    vocab = json.loads((Path(tokenizer) / "config.json").read_text())["vocab_size"]
    dataset = DatasetConfig(num_prompts=num_prompts, vocab_size=vocab, prompt_len=args.input_len,
                            output_len=args.output_len, len_sigma=0.0)
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    res = summarize_run(run_serve(ServeConfig(url, api_key=key, model=SERVED_NAME, request_rate=rate, slo=slo,
                                              dataset=dataset)))
    counts = res["counts"]
    return {"completed": counts["completed"], "failed": counts["failed"],
            "request_throughput": res["request_throughput_req_s"], "request_goodput": res["goodput_req_s"],
            **{f"{name}_{metric}_ms": res[f"{metric}_ms"][percentile]
               for metric in ("ttft", "tpot", "itl") for name, percentile in (("median", "p50"), ("p99", "p99"))}}


def server_commands(model: str, stagedserve_model: str | None, port: int, key: str,
                    vllm_python: str | None) -> dict[str, tuple[list[str], dict]]:
    """Each server on its defaults, on ``model`` (stagedserve on ``stagedserve_model`` where given)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    commands = {STAGEDSERVE: ([sys.executable, "-m", "stage5_server", "serve", stagedserve_model or model, *common,
                               "--no-compile-in-background"],
                              {**os.environ, "STAGEDSERVE_API_KEY": key})}
    if vllm_python:
        commands[VLLM] = ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                           "--api-key", key, *common],
                          {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4",
                           "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    return commands


def ratios(result: dict) -> dict[str, dict[str, float]]:
    """Per rate, stagedserve's goodput over vLLM's and its TPOT p50 over vLLM's; and the best goodputs'."""
    rows = result["rows"]
    if STAGEDSERVE not in rows or VLLM not in rows:
        return {}
    ours, theirs = rows[STAGEDSERVE], rows[VLLM]
    out = {rate: {"goodput": ours[rate]["request_goodput"] / max(theirs[rate]["request_goodput"], 1e-9),
                  "tpot_p50": ours[rate]["median_tpot_ms"] / theirs[rate]["median_tpot_ms"]}
           for rate in ours if rate in theirs}
    best = [max(r["request_goodput"] for r in server.values()) for server in (ours, theirs)]
    out["best"] = {"goodput": best[0] / max(best[1], 1e-9)}
    return out


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    details = f"load average {result['load_average']:.2f} before, vLLM {result['vllm_version'] or 'not run'}"
    lines = [f"{provenance(result, details)}.",
             "", f"`{result['load']}`: {cfg['num_prompts']} chat requests at each rate, {cfg['input_len']} random "
             f"prompt tokens and {cfg['output_len']} output tokens each, Poisson arrivals at "
             f"{', '.join(map(str, cfg['rates']))} requests/s in turn; goodput: TTFT under {cfg['slo_ttft_ms']} ms "
             f"and TPOT under {cfg['slo_tpot_ms']} ms. Weights: {result['weights']}.", "",
             "| server | rate req/s | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|---:|" + "---:|" * len(COLUMNS)]
    for label, by_rate in result["rows"].items():
        for rate, metrics in by_rate.items():
            lines.append(f"| {label} | {rate} | " + " | ".join(fmt.format(metrics[key]) for _, key, fmt in COLUMNS)
                         + " |")
    for label, why in result["skipped"].items():
        lines.append(f"| {label} | not run: {why[:80]} |" + " |" * len(COLUMNS))
    if result["ratios"]:
        per_rate = "; ".join(f"{rate} req/s: goodput {r['goodput']:.2f}x, TPOT p50 {r['tpot_p50']:.2f}x"
                             for rate, r in result["ratios"].items() if rate != "best")
        lines += ["", f"stagedserve against vLLM (same run): {per_rate}; best goodput over the rates "
                      f"{result['ratios']['best']['goodput']:.2f}x."]
    lines += ["", f"![Goodput and TPOT p50 against the request rate]({result['figure']})"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (label, by_rate), color in zip(result["rows"].items(), ("#264653", "#e76f51")):
        rates = [float(r) for r in by_rate]
        for ax, key in zip(axes, ("request_goodput", "median_tpot_ms")):
            ax.plot(rates, [m[key] for m in by_rate.values()], "o-", color=color, label=label)
    axes[0].plot(rates, rates, ":", color="gray", label="offered")
    slo = result["config"]["slo_tpot_ms"]
    axes[1].axhline(slo, linestyle="--", color="gray", label=f"TPOT SLO {slo} ms")
    for ax, ylabel in zip(axes, ("goodput (req/s meeting both SLOs)", "TPOT p50 (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from shared.named_models import default_model, default_model_file

    ap = benchmark_parser(__doc__, NAME, plot=True)
    ap.add_argument("--vllm-python", default=os.environ.get("STAGEDSERVE_VLLM_PYTHON"),
                    help="vLLM's python: its server is the peer and its bench serve the load ('': stagedserve alone)")
    ap.add_argument("--model", default="bf16",
                    help="bf16 (the default model as a bfloat16 directory), gguf (stagedserve on the GGUF file, vLLM "
                         "on the directory it converts to) or a Hugging Face directory")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slo-ttft-ms", type=int, default=2000)
    ap.add_argument("--slo-tpot-ms", type=int, default=100)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.model == "gguf":  # the GGUF run's report sits beside the sweep's
        name = f"{NAME}_gguf"
        args.markdown = args.markdown.replace(f"{NAME}.md", f"{name}.md")
        args.plot = args.plot.replace(f"{NAME}.png", f"{name}.png")
    else:
        name = NAME
    started = time.perf_counter()
    stagedserve_model = None
    if args.model == "bf16":
        model, weights = bf16_checkpoint(default_model()), "the default model as a bfloat16 directory"
    elif args.model == "gguf":
        model, stagedserve_model = default_model(), str(default_model_file())
        weights = "stagedserve on the default model's GGUF file, vLLM on the directory it converts to"
    else:
        model, weights = args.model, f"`{Path(args.model).name}`"
    key = secrets.token_urlsafe(16)
    bench = vllm_bench if args.vllm_python else own_bench
    result = {**run_info(f"benchmarks.{NAME}", argv), "load_average": os.getloadavg()[0], "weights": weights,
              "config": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "rates",
                                                       "slo_ttft_ms", "slo_tpot_ms")},
              "rows": {}, "skipped": {} if args.vllm_python else {VLLM: "no --vllm-python"},
              "figure": f"assets/{Path(args.plot).name}"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result["load"] = ("OPENAI_API_KEY=$KEY vllm bench serve " if args.vllm_python else "stagedserve bench serve ") + \
        shown(load_args(url, key, model, args, args.rates[0], args.num_prompts), key, model).replace(
            url, "http://127.0.0.1:PORT").replace(f"--request-rate {args.rates[0]}", "--request-rate RATE")
    for label, (command, env) in server_commands(model, stagedserve_model, port, key, args.vllm_python).items():
        try:
            with server(command, url, env, args.startup_timeout):
                bench(url, key, model, args, 16.0, WARMUP_PROMPTS)  # warm-up: not counted
                for rate in args.rates:
                    metrics = bench(url, key, model, args, rate, args.num_prompts)
                    result["rows"].setdefault(label, {})[str(rate)] = metrics
                    print(f"{label} at {rate} req/s: goodput {metrics['request_goodput']:.2f} req/s, "
                          f"TPOT p50 {metrics['median_tpot_ms']:.0f} ms", flush=True)
        except RuntimeError as exc:  # a server that does not start, or a load that fails, is reported, not fatal
            result["skipped"][label] = str(exc).splitlines()[-1]
    result["ratios"] = ratios(result)
    result["vllm_version"] = subprocess.run(
        [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
        text=True).stdout.strip().splitlines()[-1] if args.vllm_python else None
    result["runtime_s"] = time.perf_counter() - started
    write_results(name, result, to_markdown(result), args.out_dir, args.markdown)
    if result["rows"]:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
