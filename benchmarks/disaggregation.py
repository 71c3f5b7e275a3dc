"""Prefill/decode disaggregation on a CPU: one server on two cores against a prefill and a decode server on
one core each, behind the proxy, at rising request rates.

- **one server**: ``stagedserve serve`` pinned to cores 0-1 (``taskset``), two torch threads;
- **prefill + decode**: a ``kv_producer`` server pinned to core 0 and a ``kv_consumer`` server pinned to core 1,
  one torch thread each, and ``stagedserve disagg-proxy`` in front of them (in this process).

Each serves the default model on its CPU defaults. The load is stagedserve's ``bench serve`` (Poisson
arrivals, streaming completions of random prompts of ``--prompt-len`` tokens answered with ``--output-len``,
EOS ignored) at each of ``--rates``, ``--num-prompts`` requests a rate; goodput counts the requests meeting
a ``--slo-ttft-ms`` time to first token and a ``--slo-tpot-ms`` time per output token.

    python -m benchmarks.disaggregation [--rates 0.25 0.5 1.0 --num-prompts 24 --prompt-len 256 --output-len 128]

Writes ``benchmarks/results/disaggregation.json`` and ``docs/results/disaggregation.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import benchmark_parser, provenance, run_info, write_results

NAME = "disaggregation"
REPO = Path(__file__).resolve().parents[1]
SECRET = "disaggregation-benchmark-salt-secret-0123456789"
KV_SECRET = "kv-transfer-" + "0123456789abcdef" * 2  # the channel's shared secret (kv_transfer/peer_auth.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cores: str, threads: int, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "stage5_server", "serve", "--port", str(port), "--cpu-threads", str(threads),
               "--log-stats-interval", "0", "--uvicorn-log-level", "warning", *flags]
    if shutil.which("taskset"):
        command = ["taskset", "-c", cores, *command]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads),
           "STAGEDSERVE_CACHE_SALT_SECRET": SECRET, "STAGEDSERVE_KV_TRANSFER_SECRET": KV_SECRET}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise TimeoutError("the server did not start")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def bench(url: str, rate: float, seed: int, args) -> dict:
    """One rate's run; ``seed``: its prompts (each rate its own, so no rate finds the last one's in a cache)."""
    from stage5_server.bench.datasets import DatasetConfig
    from stage5_server.bench.goodput import SLO
    from stage5_server.bench.report import summarize_run
    from stage5_server.bench.serve import ServeConfig, run_serve

    config = ServeConfig(base_url=url, request_rate=rate, seed=seed, warmup_requests=2,
                         slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
                         dataset=DatasetConfig(num_prompts=args.num_prompts, seed=seed,
                                               prompt_len=args.prompt_len, output_len=args.output_len, len_sigma=0.0))
    summary = summarize_run(run_serve(config))
    return {"rate": rate, "completed": summary["counts"]["completed"], "failed": summary["counts"].get("failed", 0),
            "goodput_req_s": summary["goodput_req_s"], "ttft_p50_ms": summary["ttft_ms"].get("p50"),
            "ttft_p99_ms": summary["ttft_ms"].get("p99"), "tpot_p50_ms": summary["tpot_ms"].get("p50"),
            "tpot_p99_ms": summary["tpot_ms"].get("p99"), "errors": summary["errors"]}


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, NAME)
    parser.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--slo-tpot-ms", type=float, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from stage5_server.kv_transfer.proxy import create_proxy_app
    from stage5_server.server import ServerThread

    model = [args.model] if args.model else []
    logs = Path(tempfile.mkdtemp(prefix="disaggregation-"))
    rows = {"one server (2 cores)": [], "prefill + decode (1 core each)": []}
    single, single_url = start_server("0,1", 2, logs / "single.log", *model)
    try:
        rows["one server (2 cores)"] = [bench(single_url, rate, args.seed + i, args)
                                        for i, rate in enumerate(args.rates)]
    finally:
        stop(single)
    kv_port = free_port()
    extra = {"kv_port": kv_port}
    decode, decode_url = start_server("1", 1, logs / "decode.log", *model, "--kv-transfer-config", json.dumps(
        {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": extra}))
    prefill = None
    try:
        prefill, prefill_url = start_server("0", 1, logs / "prefill.log", *model, "--kv-transfer-config", json.dumps(
            {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}))
        with ServerThread(create_proxy_app(prefill_url, decode_url)) as proxy:
            rows["prefill + decode (1 core each)"] = [bench(proxy.url, rate, args.seed + i, args)
                                                        for i, rate in enumerate(args.rates)]
        received = httpx.get(decode_url + "/metrics").text
    finally:
        for process in (prefill, decode):
            if process is not None:
                stop(process)
    p2p_tokens = sum(float(line.rsplit(" ", 1)[1]) for line in received.splitlines()
                     if line.startswith("vllm:prompt_tokens_cached_by_source_total") and 'source="p2p"' in line)
    result = {**run_info(f"benchmarks.{NAME}", argv), "settings": {k: v for k, v in vars(args).items()
                                                                   if k not in ("out_dir", "markdown")},
              "rows": rows, "decode_p2p_hit_tokens": p2p_tokens}
    lines = [provenance(result, f"{'the default' if args.model is None else Path(args.model).name} model on its CPU "
                              "defaults"), "",
             f"Poisson arrivals, {args.num_prompts} streamed completions a rate, {args.prompt_len} prompt tokens, "
             f"{args.output_len} output tokens; goodput: TTFT <= {args.slo_ttft_ms:.0f} ms and TPOT <= "
             f"{args.slo_tpot_ms:.0f} ms; each rate its own prompts. The decode server took {p2p_tokens:,.0f} prompt "
             "tokens from the prefill server.", "",
             "| setup | req/s offered | completed | goodput req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
             "| TPOT p99 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for setup, results in rows.items():
        for row in results:
            lines.append(f"| {setup} | {row['rate']:g} | {row['completed']} | {row['goodput_req_s']:.2f} | "
                         f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.0f} | "
                         f"{row['tpot_p99_ms']:.0f} |")
    write_results(NAME, result, "\n".join(lines) + "\n", args.out_dir, args.markdown)


if __name__ == "__main__":
    main()
