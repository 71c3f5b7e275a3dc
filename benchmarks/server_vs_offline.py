"""The server path against the offline engine, same workload, same concurrency.

One seeded random workload runs twice through stage5's engine: offline with
``LLM.generate`` (``max_num_seqs = C``), then through the HTTP server started as its own
process (``stagedserve serve --no-engine-process``: engine core on a thread, so one process
holds the whole server's CPU time), driven by ``stagedserve bench serve``'s load
generator from this process (streaming completions, ``max_concurrency = C``, all requests
sent at once). Output tokens per second of each, and the ratio: what HTTP, JSON, SSE and
the async engine thread cost. The ratio is the share of the offline throughput the server
keeps. Beside it, each request's time per output token (TPOT), p50: offline from the
engine's own token times, served from the tokens' arrival at the client.

``--engine-process`` serves as deployed instead: the engine core in a process of its own
(``stagedserve serve``'s default), so the two processes share the cores.

    python -m benchmarks.server_vs_offline [--models tiny small --num-prompts 64 --concurrency 16]
    python -m benchmarks.server_vs_offline --models default --concurrency 1 16 --num-prompts 16 \
        --engine-process --markdown docs/results/server_vs_offline_default.md
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams, resolve_model, summarize
from shared.gguf import is_gguf
from shared.named_models import default_model_file
from stage5_server.bench.datasets import DatasetConfig, build_dataset
from stage5_server.bench.report import summarize_run
from stage5_server.bench.serve import ServeConfig, run_serve
from stage5_server.llm import LLM


def run(model: str, num_prompts: int, concurrency: int, seed: int = 0, engine_process: bool = False) -> dict:
    dataset = DatasetConfig(name="random", num_prompts=num_prompts, seed=seed, prompt_len=48, output_len=48,
                            len_sigma=0.6, max_prompt_len=192, max_output_len=192)
    requests = build_dataset(dataset)
    engine_kwargs = dict(max_model_len=512, max_num_seqs=concurrency, max_num_batched_tokens=512, device="cpu",
                         enable_prefix_caching=False, seed=0)

    offline = LLM(model, **engine_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    offline.generate([requests[0].prompt], params[0], use_tqdm=False)  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = offline.generate([r.prompt for r in requests], params, use_tqdm=False)
    offline_s, offline_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    offline_tpot = [o.timeline.tpot for o in outs if o.timeline.tpot is not None]
    del offline  # its memory and threads, before the server starts

    # In-process: the CPU per token below is one process's; benchmarks.engine_process compares the split.
    extra_args = () if engine_process else ("--no-engine-process",)
    with served_in_subprocess(model, engine_kwargs, extra_args=extra_args, timeout_s=300) as (url, api_key, pid):
        config = ServeConfig(base_url=url, api_key=api_key, model="bench", max_concurrency=concurrency,
                             warmup_requests=2, dataset=dataset, seed=seed)
        cpu_before = process_cpu_seconds(pid)
        served = summarize_run(run_serve(config))
        server_cpu_s = process_cpu_seconds(pid) - cpu_before if cpu_before is not None else None
    server_tps = served["output_token_throughput_tok_s"]
    offline_tps = offline_tokens / offline_s
    return {"config": {"model": Path(model).name, "num_prompts": num_prompts, "concurrency": concurrency,
                       "engine": engine_kwargs, "threads": torch.get_num_threads(), "engine_process": engine_process},
            "offline": {"wall_s": offline_s, "output_tokens": offline_tokens, "output_tok_s": offline_tps,
                        "tpot_ms": {k: v * 1e3 for k, v in summarize(offline_tpot).items()},
                        "cpu_ms_per_token": 1e3 * offline_cpu_s / offline_tokens},
            "server": {"window_s": served["window_s"] if "window_s" in served else None,
                       "completed": served.get("completed"), "failed": served.get("failed"),
                       "output_tokens": served["total_output_tokens"], "output_tok_s": server_tps,
                       "ttft_ms": served.get("ttft_ms"), "itl_ms": served.get("itl_ms"),
                       "tpot_ms": served.get("tpot_ms"),
                       "cpu_ms_per_token": (1e3 * server_cpu_s / served["total_output_tokens"]
                                            if server_cpu_s is not None and served["total_output_tokens"] else None)},
            "server_over_offline": server_tps / offline_tps}


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux ``/proc``; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def served_in_subprocess(model: str, engine_kwargs: dict, timeout_s: float = 120.0, extra_args: tuple[str, ...] = (),
                         prefix_caching: bool = False, omp_threads: int | None | str = "this process"):
    """``stagedserve serve`` on a free loopback port, with a fresh key; stopped with SIGINT.

    ``omp_threads``: the servers' ``OMP_NUM_THREADS`` (default: this process's torch threads; None: unset, so
    the server splits the cores itself)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    api_key = secrets.token_urlsafe(24)
    flags = {"max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
             "max_num_batched_tokens": "--max-num-batched-tokens", "device": "--device", "seed": "--seed"}
    cmd = [sys.executable, "-m", "stage5_server", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", "--log-stats-interval", "0",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    for name, flag in flags.items():
        cmd += [flag, str(engine_kwargs[name])]
    cmd += list(extra_args)
    env = {**os.environ, "STAGEDSERVE_API_KEY": api_key}
    env.pop("OMP_NUM_THREADS", None)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads() if omp_threads == "this process" else omp_threads)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy in time")
            time.sleep(0.2)
        yield url, api_key, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def to_markdown(result: dict) -> str:
    first = result["runs"][0]["config"]
    where = ("the server as deployed: its engine core in a process of its own" if first.get("engine_process")
             else "the server in its own process, its engine core on a thread")
    lines = [
        "### Server path vs offline engine",
        "",
        provenance(result, f"{first['threads']} torch thread(s)") + f"; {first['num_prompts']} "
        f"requests, greedy, EOS ignored; {where}.",
        "",
        "| model | concurrency | offline tok/s | server tok/s (streaming) | server / offline | "
        "TPOT p50 ms, offline | TPOT p50 ms, server | server / offline | CPU ms per token, offline | "
        f"CPU ms per token, {'API server process' if first.get('engine_process') else 'server process'} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(value):
        return "n/a" if value is None else f"{value:.3f}"

    for r in result["runs"]:
        offline_tpot, server_tpot = r["offline"]["tpot_ms"]["p50"], r["server"]["tpot_ms"]["p50"]
        lines.append(f"| `{r['config']['model']}` | {r['config']['concurrency']} | "
                     f"{r['offline']['output_tok_s']:.1f} | "
                     f"{r['server']['output_tok_s']:.1f} | {100 * r['server_over_offline']:.0f}% | "
                     f"{offline_tpot:.2f} | {server_tpot:.2f} | {server_tpot / offline_tpot:.2f}x | "
                     f"{ms(r['offline']['cpu_ms_per_token'])} | {ms(r['server']['cpu_ms_per_token'])} |")
    lines += [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "server_vs_offline")
    ap.add_argument("--models", nargs="+", default=["tiny", "small"],
                    help="checkpoint dirs, or 'tiny' (2 layers) / 'small' (4 layers), random llamas")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine-process", action="store_true",
                    help="serve as deployed: the engine core in its own process (default: on a thread)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    # The default model as the engines load it: its GGUF file (4-bit blocks kept), not its converted directory.
    models = [str(default_model_file()) if m == "default" else m if is_gguf(m) else resolve_model(m)
              for m in args.models]
    result = {**run_info("benchmarks.server_vs_offline", argv),
              "runs": [run(m, args.num_prompts, c, engine_process=args.engine_process)
                       for m in models for c in args.concurrency]}
    # The JSON beside it takes the table's name, so the deployed run's does not replace the default's.
    write_results(Path(args.markdown).stem, result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
