"""Scheduler and input preparation per decode step: stage5's persistent input batch against
stage 3's list-built inputs, side by side on the same steps.

``B`` requests decode together in steady state on stage5 (the tiny random checkpoint on a CPU,
so the forward pass is short; it is not timed): they run long enough to outlast the prefills of
the last ones, and the benchmark checks that each measured step holds all ``B``. For every
measured step it times:

- the scheduler: ``schedule()`` (stage 4's decision, described for the workers: new requests whole,
  running ones as deltas; ``stage5_server/core/scheduler.py``) and ``update_from_output()`` (the
  tokens appended, the front end's outputs made);
- the inputs stage5 hands the model: ``InputBatch.prepare`` (the rows brought up to date and the
  tensors gathered; ``stage5_server/worker/``);
- on the same step's requests, the preparation stages 3 and 4 do (``prepare_inputs``,
  ``kv_layout``, ``build_paged_metadata``), whose tensors are the same.

"scheduler + inputs" is ``schedule`` + ``update_from_output`` + ``prepare``: the engine's own work per
step outside the forward pass and sampling, before output processing.

    python -m benchmarks.step_overhead [--batch-sizes 64 256 --prompt-len 128 --steps 50]
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams, resolve_model, summarize
from shared.model_runner import prepare_inputs
from stage2_paged.attention import build_paged_metadata
from stage3_continuous.engine import kv_layout

BLOCK_SIZE = 16


def list_built_inputs(step, scheduler, block_size: int) -> None:
    """Stage 3's preparation of one step's inputs from the live requests (the tensors are discarded)."""
    batch = [(scheduler.requests[rid], n) for rid, n in step.num_scheduled_tokens.items()]
    tables = {rid: scheduler.kv_cache_manager.get_block_ids(rid) for rid in step.num_scheduled_tokens}
    inputs = prepare_inputs(batch, "cpu")
    slots, tables = kv_layout(batch, tables, block_size)
    build_paged_metadata(slots, inputs.query_start_loc, inputs.seq_lens, tables, "cpu")


def measure(model: str, batch_size: int, prompt_len: int, steps: int, threads: int = 1) -> dict:
    from stage5_server import LLM

    budget = max(512, 4 * prompt_len)
    # While the last prompts prefill, the first requests decode (their tokens come out of the same
    # budget): they must not finish before the measured steps, so every request outlasts both.
    max_tokens = -(-batch_size * prompt_len // max(budget - batch_size, prompt_len)) + steps + 16
    max_len = prompt_len + max_tokens + 1
    llm = LLM(model=model, device="cpu", max_model_len=max_len, max_num_seqs=batch_size,
              max_num_batched_tokens=budget, enable_prefix_caching=False, block_size=BLOCK_SIZE,
              cpu_threads=threads,
              num_kv_blocks=batch_size * (-(-max_len // BLOCK_SIZE) + 1))
    engine = llm.engine
    scheduler = engine.scheduler
    input_batch = engine.model_executor.driver_worker.model_runner.input_batch
    timings: dict[str, list[float]] = {"schedule": [], "update": [], "prepare": [], "prepare_lists": []}
    recording = [False]

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if recording[0]:
                timings[name].append(time.perf_counter() - start)
            return result
        return run

    prepare = timed("prepare", input_batch.prepare)
    lists = timed("prepare_lists", list_built_inputs)

    schedule = timed("schedule", scheduler.schedule)
    scheduled_outputs = []

    def schedule_and_keep():
        output = schedule()
        if recording[0]:
            scheduled_outputs.append(output)
        return output

    def prepare_both(step):
        lists(step, scheduler, input_batch.block_size)  # before prepare: the requests as scheduled
        return prepare(step)

    scheduler.schedule = schedule_and_keep
    scheduler.update_from_output = timed("update", scheduler.update_from_output)
    input_batch.prepare = prepare_both
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch_size):
        llm.add_request([(7 * i + j) % 500 + 3 for j in range(prompt_len)], params)
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        llm.step()  # the prefills are not what we measure
    recording[0] = True
    for _ in range(steps):
        llm.step()
    recording[0] = False
    running = {len(output.num_scheduled_tokens) for output in scheduled_outputs}
    if running != {batch_size}:
        raise RuntimeError(f"expected {batch_size} requests in each measured step, got {sorted(running)}")
    llm.abort([str(i) for i in range(batch_size)])
    p50 = {name: summarize(values)["p50"] * 1e3 for name, values in timings.items()}
    mean = {name: 1e3 * sum(values) / len(values) for name, values in timings.items()}
    ours = p50["schedule"] + p50["update"] + p50["prepare"]
    return {"batch_size": batch_size, "steps": len(timings["schedule"]), "p50_ms": p50, "mean_ms": mean,
            "scheduler_and_inputs_ms_p50": ours,
            "scheduler_and_list_inputs_ms_p50": p50["schedule"] + p50["update"] + p50["prepare_lists"],
            "prepare_speedup": p50["prepare_lists"] / p50["prepare"]}


def to_markdown(result: dict) -> str:
    c = result["config"]
    load = result["load_average"]
    lines = [
        "### Scheduler and input preparation per decode step",
        "",
        provenance(result, f"{c['threads']} torch thread(s); load average {load['before'][0]:.2f} before, "
                   f"{load['after'][0]:.2f} after") + f"; model `{c['model']}`, stage5, prompts of "
        f"{c['prompt_len']} tokens, block size {BLOCK_SIZE}, p50 over {c['steps']} decode steps.",
        "",
        "| running requests | schedule ms | update ms | inputs ms (persistent batch) | inputs ms (lists) | "
        "inputs: lists / persistent | scheduler + inputs ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        p = r["p50_ms"]
        lines.append(f"| {r['batch_size']} | {p['schedule']:.3f} | {p['update']:.3f} | "
                     f"{p['prepare']:.3f} | "
                     f"{p['prepare_lists']:.3f} | {r['prepare_speedup']:.1f}x | "
                     f"{r['scheduler_and_inputs_ms_p50']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "step_overhead")
    ap.add_argument("--model", default="tiny", help="checkpoint dir or name (tiny, small, default); default: tiny")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    start = time.perf_counter()
    result = {**run_info("benchmarks.step_overhead", argv), "load_average": {"before": os.getloadavg()},
              "config": {"model": Path(model).name, "threads": args.threads, "steps": args.steps,
                         "prompt_len": args.prompt_len}}
    result["rows"] = [measure(model, b, args.prompt_len, args.steps, args.threads) for b in args.batch_sizes]
    result["load_average"]["after"] = os.getloadavg()
    result["runtime_s"] = round(time.perf_counter() - start, 3)
    write_results("step_overhead", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
