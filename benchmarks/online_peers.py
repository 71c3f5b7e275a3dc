"""``stagedserve serve`` against vLLM's CPU server, as deployed: each on its defaults, one after the
other, under the same load from vLLM's own ``bench serve``.

The load: chat requests (``--backend openai-chat``) of random 256-token prompts, 128 output tokens
each (EOS ignored), arriving as a Poisson process at 1.5 requests/s, 48 in all; goodput counts the
requests that meet both a 2 s TTFT and a 150 ms TPOT. Both servers serve the default model (the
directory its GGUF file converts to) on all the CPUs, with an API key; vLLM with
``VLLM_CPU_OMP_THREADS_BIND=nobind`` and a 4 GiB KV cache. The benchmark runs from vLLM's own
virtual environment, as ``benchmarks/load_clients.py`` runs it.

    STAGEDSERVE_VLLM_PYTHON=<vllm venv>/bin/python python -m benchmarks.online_peers

Writes ``benchmarks/results/online_peers.json`` and ``docs/results/online_peers.md``.
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
from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from benchmarks.load_clients import BENCH, shown

NAME = "online_peers"
SERVED_NAME = "smollm2"
COLUMNS = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
           ("req/s", "request_throughput", "{:.2f}"), ("goodput req/s", "request_goodput", "{:.2f}"),
           ("TTFT p50 ms", "median_ttft_ms", "{:.0f}"), ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
           ("TPOT p50 ms", "median_tpot_ms", "{:.0f}"), ("TPOT p99 ms", "p99_tpot_ms", "{:.0f}"),
           ("ITL p50 ms", "median_itl_ms", "{:.0f}"), ("ITL p99 ms", "p99_itl_ms", "{:.0f}")]


def load_args(url: str, key: str, tokenizer: str, args) -> list[str]:
    return ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", SERVED_NAME, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", "0",
            "--ignore-eos", "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--header", f"Authorization=Bearer {key}"]


def server_commands(model: str, port: int, key: str, vllm_python: str) -> dict[str, tuple[list[str], dict]]:
    """Each server on its defaults: stagedserve on the default model's GGUF file (as ``stagedserve serve``
    with no model runs it), vLLM on the directory that file converts to (``model``)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    return {
        "stagedserve serve": ([sys.executable, "-m", "stage5_server", "serve", *common],  # the default model
                              {**os.environ, "STAGEDSERVE_API_KEY": key}),
        "vLLM's CPU server": ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                              "--api-key", key, *common],
                             {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4",
                              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
    }


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    details = f"load average {result['load_average']:.2f} before, vLLM {result['vllm_version']}"
    lines = [f"{provenance(result, details)}.",
             "", f"`OPENAI_API_KEY=$KEY vllm bench serve {result['args']}`: {cfg['num_prompts']} chat requests, "
             f"{cfg['input_len']} random prompt tokens and {cfg['output_len']} output tokens each, at "
             f"{cfg['request_rate']} requests/s (Poisson); goodput: TTFT under {cfg['slo_ttft_ms']} ms and TPOT "
             f"under {cfg['slo_tpot_ms']} ms.", "",
             "| server | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for label, metrics in result["rows"].items():
        lines.append(f"| {label} | " + " | ".join(fmt.format(metrics[key]) for _, key, fmt in COLUMNS) + " |")
    for label, why in result["skipped"].items():
        lines.append(f"| {label} | not run: {why[:80]} |" + " |" * (len(COLUMNS) - 1))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from shared.named_models import default_model

    ap = benchmark_parser(__doc__, NAME)
    ap.add_argument("--vllm-python", default=os.environ.get("STAGEDSERVE_VLLM_PYTHON"))
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=1.5)
    ap.add_argument("--slo-ttft-ms", type=int, default=2000)
    ap.add_argument("--slo-tpot-ms", type=int, default=150)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    if not args.vllm_python:
        ap.error("give --vllm-python (or set STAGEDSERVE_VLLM_PYTHON): the load comes from vLLM's bench serve")
    started = time.perf_counter()
    model, key = default_model(), secrets.token_urlsafe(16)
    result = {**run_info(f"benchmarks.{NAME}", argv), "load_average": os.getloadavg()[0],
              "config": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "request_rate",
                                                       "slo_ttft_ms", "slo_tpot_ms")}, "rows": {}, "skipped": {}}
    with tempfile.TemporaryDirectory() as result_dir:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        result["args"] = shown(load_args(url, key, model, args), key, model).replace(url, "http://127.0.0.1:PORT")
        for i, (label, (command, env)) in enumerate(server_commands(model, port, key, args.vllm_python).items()):
            bench = load_args(url, key, model, args)
            save = ["--save-result", "--result-dir", result_dir, "--result-filename", f"{i}.json"]
            try:
                with server(command, url, env, args.startup_timeout):
                    done = subprocess.run([args.vllm_python, "-c", BENCH, *bench, *save], capture_output=True,
                                          text=True, env={**os.environ, "OPENAI_API_KEY": key})
            except RuntimeError as exc:  # a server that does not start is reported, not fatal
                result["skipped"][label] = str(exc).splitlines()[-1]
                continue
            if done.returncode != 0:
                result["skipped"][label] = f"bench serve failed: {done.stderr.strip().splitlines()[-1:]}"
                continue
            metrics = json.loads((Path(result_dir) / f"{i}.json").read_text())
            result["rows"][label] = {k: v for k, v in metrics.items() if not isinstance(v, list)}
            print(f"{label}: goodput {metrics['request_goodput']:.2f} req/s, "
                  f"TPOT p50 {metrics['median_tpot_ms']:.0f} ms", flush=True)
            for path_key in ("model_id", "tokenizer_id"):
                result["rows"][label][path_key] = Path(str(metrics.get(path_key))).name
    result["vllm_version"] = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    result["runtime_s"] = time.perf_counter() - started
    write_results(NAME, result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
