"""Where a served token's time goes under load: the engine's steps by kind, the time between them, and the
two processes' share of the CPUs, served (``stagedserve serve``) against the offline engine on the same
requests arriving at the same times.

At each rate (default 2 and 4 requests/s), 64 requests of 256 random prompt tokens and 128 output tokens
(EOS ignored) arrive as a Poisson process:

- served: ``stagedserve serve`` on its defaults (but compiling before it listens, as the offline engine does,
  so that no compiler shares the CPUs with the load), driven by stagedserve's own ``bench serve`` (token-id
  prompts on ``/v1/completions``), its engine core logging every step (``STAGEDSERVE_STEP_LOG``,
  ``stage5_server/core/step_log.py``); the API server's and the engine core's CPU seconds from ``/proc``;
- offline: an ``LLM`` with the server's batch settings in this process, each request added at its arrival
  time and the engine stepped in between, logging its steps the same way.

For each: the steps of decodes only, by rows, and the steps with prompt tokens (prefill chunks, alone or
beside decodes), with their mean milliseconds (schedule + execute + update); the time between steps while
requests were running (the core loop: outputs sent, inputs received); and TPOT p50.

    python -m benchmarks.served_profile [--rates 2 4] [--model bf16] [--engine-args '{"enforce_eager": true}']

Writes ``benchmarks/results/served_profile.json`` and ``docs/results/served_profile.md``.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.api_oracle import free_port, server
from benchmarks.common import benchmark_parser, bf16_checkpoint, provenance, run_info, write_results
from benchmarks.online_peers import SERVED_NAME, own_bench
from benchmarks.server_vs_offline import process_cpu_seconds

NAME = "served_profile"
ROW_BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 1 << 20))
SERVER_BATCH = dict(max_num_seqs=128, max_num_batched_tokens=2048)  # stagedserve serve's defaults
WARMUP_PROMPTS = 4


def step_kind(step: dict) -> str:
    if step["prompt_tokens"]:
        return "with prompt tokens"
    low, high = next(b for b in ROW_BUCKETS if b[0] <= step["decodes"] <= b[1])
    return f"decodes {low}-{high}" if high < 1 << 20 else f"decodes {low}+"


def summarize_steps(steps: list[dict], cpu_s: dict[str, float | None]) -> dict:
    """Steps by kind, the gaps between steps while requests ran, the window and each process's CPU share."""
    window = steps[-1]["start"] + _seconds(steps[-1]) - steps[0]["start"]
    kinds: dict[str, list[dict]] = {}
    for step in steps:
        kinds.setdefault(step_kind(step), []).append(step)
    gaps = [b["start"] - a["start"] - _seconds(a) for a, b in zip(steps, steps[1:])]
    busy_gaps = [g for g in gaps if g < 0.05]  # longer: nothing was running (waiting for an arrival)
    order = [step_kind({"prompt_tokens": 0, "decodes": low}) for low, _ in ROW_BUCKETS] + ["with prompt tokens"]
    return {
        "window_s": window, "steps": len(steps), "step_s": sum(map(_seconds, steps)),
        "kinds": {kind: {"steps": len(kinds[kind]), "mean_ms": 1e3 * statistics.mean(map(_seconds, kinds[kind])),
                         "mean_decodes": statistics.mean(s["decodes"] for s in kinds[kind]),
                         "mean_prompt_tokens": statistics.mean(s["prompt_tokens"] for s in kinds[kind]),
                         "seconds": sum(map(_seconds, kinds[kind]))} for kind in order if kind in kinds},
        "between_steps_s": sum(busy_gaps), "between_steps_ms": 1e3 * statistics.mean(busy_gaps) if busy_gaps else 0,
        "cpu_cores": {name: None if s is None else s / window for name, s in cpu_s.items()},
    }


def _seconds(step: dict) -> float:
    return step["schedule_s"] + step["execute_s"] + step["update_s"]


def cli_flags(engine_args: dict) -> list[str]:
    """Engine arguments as ``stagedserve serve``'s flags (a bool: ``--flag`` or ``--no-flag``)."""
    flags = []
    for name, value in engine_args.items():
        flag = name.replace("_", "-")
        flags += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return flags


def served(model: str, rate: float, args, log_dir: Path) -> dict:
    key, port = secrets.token_urlsafe(16), free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "stage5_server", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_NAME, *cli_flags({"compile_in_background": False, **args.engine})]
    env = {**os.environ, "STAGEDSERVE_API_KEY": key, "STAGEDSERVE_STEP_LOG": str(log_dir)}
    with server(command, url, env, args.startup_timeout) as proc:
        own_bench(url, key, model, args, 16.0, WARMUP_PROMPTS)  # warm-up: not counted
        [log] = log_dir.glob("steps-*.jsonl")  # the engine core's, named by its process id
        engine_pid, skip = int(log.stem.removeprefix("steps-")), len(log.read_text().splitlines())
        cpu_before = {"API server": process_cpu_seconds(proc.pid), "engine core": process_cpu_seconds(engine_pid)}
        metrics = own_bench(url, key, model, args, rate, args.num_prompts)
        cpu = {name: None if before is None else process_cpu_seconds(pid) - before
               for (name, before), pid in zip(cpu_before.items(), (proc.pid, engine_pid))}
    steps = [json.loads(line) for line in log.read_text().splitlines()[skip:]]
    return {**summarize_steps(steps, cpu), "tpot_p50_ms": metrics["median_tpot_ms"],
            "ttft_p50_ms": metrics["median_ttft_ms"], "goodput": metrics["request_goodput"]}


def offline(model: str, rate: float, args, log_dir: Path) -> dict:
    """The same requests (``bench serve``'s random dataset) at the same Poisson times, into an ``LLM`` here."""
    from shared import SamplingParams
    from stage5_server import LLM
    from stage5_server.bench.datasets import DatasetConfig, build_dataset

    os.environ["STAGEDSERVE_STEP_LOG"] = str(log_dir)
    try:
        llm = LLM(model, seed=0, **{**SERVER_BATCH, **args.engine})
    finally:
        del os.environ["STAGEDSERVE_STEP_LOG"]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    config = DatasetConfig(num_prompts=args.num_prompts, vocab_size=vocab, prompt_len=args.input_len,
                           output_len=args.output_len, len_sigma=0.0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate([r.prompt for r in build_dataset(config, seed=1_000_003)][:WARMUP_PROMPTS], params, use_tqdm=False)
    log = log_dir / f"steps-{os.getpid()}.jsonl"
    skip = len(log.read_text().splitlines())
    rng, arrivals, now = random.Random(0), [], 0.0
    for request in build_dataset(config):
        arrivals.append((now, request.prompt))
        now += rng.expovariate(rate)
    tokens: dict[str, list[float]] = {}
    start, cpu_start, pending = time.perf_counter(), time.process_time(), list(arrivals)
    while pending or llm.has_unfinished_requests():
        clock = time.perf_counter() - start
        while pending and pending[0][0] <= clock:
            tokens[llm.add_request(pending.pop(0)[1], params)] = []
        if llm.has_unfinished_requests():
            for out in llm.step():
                tokens[out.request_id] += [time.perf_counter()] * (len(out.outputs[0].token_ids)
                                                                   - len(tokens[out.request_id]))
        else:
            time.sleep(max(0.0, pending[0][0] - clock))
    cpu = {"engine (one process)": time.process_time() - cpu_start}
    steps = [json.loads(line) for line in log.read_text().splitlines()[skip:]]
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in tokens.values() if len(t) > 1]
    del llm
    return {**summarize_steps(steps, cpu), "tpot_p50_ms": 1e3 * statistics.median(tpots)}


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    load = f"load average {result['load_average']:.2f} before"
    lines = [f"{provenance(result, load)}.", "",
             f"{cfg['num_prompts']} requests at each rate, {cfg['input_len']} random prompt tokens and "
             f"{cfg['output_len']} out; weights: {result['weights']}; engine arguments: "
             f"{json.dumps(cfg['engine']) if cfg['engine'] else 'the defaults'}. Steps: count, mean ms.", ""]
    kinds = sorted({k for run in result["runs"].values() for r in run.values() for k in r["kinds"]},
                   key=lambda k: (k.startswith("with"), int(k.split()[1].split("-")[0].rstrip("+"))
                                  if not k.startswith("with") else 0))
    lines += ["| rate | run | TPOT p50 ms | " + " | ".join(kinds) + " | between steps | busy | engine cores "
              "| API server cores |", "|---|---|---:|" + "---:|" * (len(kinds) + 4)]
    for rate, runs in result["runs"].items():
        for label, r in runs.items():
            cells = [f"{r['kinds'][k]['steps']} x {r['kinds'][k]['mean_ms']:.0f} ms" if k in r["kinds"] else "-"
                     for k in kinds]
            cores = r["cpu_cores"]
            engine = cores.get("engine core", cores.get("engine (one process)"))
            api = cores.get("API server")
            lines.append(f"| {rate} | {label} | {r['tpot_p50_ms']:.0f} | " + " | ".join(cells)
                         + f" | {r['between_steps_s']:.1f} s ({r['between_steps_ms']:.1f} ms) "
                         f"| {100 * r['step_s'] / r['window_s']:.0f}% | {engine:.2f} | "
                         f"{'-' if api is None else f'{api:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from shared.named_models import default_model

    ap = benchmark_parser(__doc__, NAME)
    ap.add_argument("--model", default="bf16", help="bf16 (the default model as a bfloat16 directory) or a directory")
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--engine-args", type=json.loads, default={}, help="engine arguments of both runs, as JSON")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    args.engine, args.slo_ttft_ms, args.slo_tpot_ms = args.engine_args, 2000, 100  # own_bench's SLO
    started = time.perf_counter()
    model = bf16_checkpoint(default_model()) if args.model == "bf16" else args.model
    result = {**run_info(f"benchmarks.{NAME}", argv), "load_average": os.getloadavg()[0],
              "weights": "the default model as a bfloat16 directory" if args.model == "bf16" else Path(model).name,
              "config": {k: getattr(args, k) for k in ("rates", "num_prompts", "input_len", "output_len", "engine")},
              "runs": {}}
    for rate in args.rates:
        with tempfile.TemporaryDirectory() as served_logs, tempfile.TemporaryDirectory() as offline_logs:
            result["runs"][str(rate)] = {"served": served(model, rate, args, Path(served_logs)),
                                         "offline": offline(model, rate, args, Path(offline_logs))}
        print(json.dumps(result["runs"][str(rate)], indent=1), flush=True)
    result["runtime_s"] = time.perf_counter() - started
    write_results(NAME, result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
