"""Engine overhead per step: everything but the model forward, as a share of the step.

For each batch size, ``B`` requests decode together in steady state (stage4's engine, torch
backend). Each step is split into the model runner's ``execute`` (input tensors, forward
pass, sampling) and the rest (scheduling, KV bookkeeping, output processing and
detokenization in the front end). The rest is the engine's overhead.

    python -m benchmarks.engine_overhead [--batch-sizes 1 4 16 64 256 --steps 30]

``--profile`` also runs the largest batch under cProfile and writes where the time goes
(``docs/results/engine_overhead_profile.txt``).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams, resolve_model, summarize
from stage4_prefix_cache import LLM


def measure(model: str, batch_size: int, steps: int, prompt_len: int = 16) -> dict:
    llm = LLM(model=model, max_model_len=prompt_len + steps + 8, max_num_seqs=batch_size,
              max_num_batched_tokens=max(256, batch_size * prompt_len), enable_prefix_caching=False,
              num_kv_blocks=batch_size * ((prompt_len + steps + 8) // 16 + 2), block_size=16)
    runner = llm.engine.runner
    execute = runner.execute
    forward_times: list[float] = []

    def timed_execute(*args, **kwargs):
        start = time.perf_counter()
        result = execute(*args, **kwargs)
        forward_times.append(time.perf_counter() - start)
        return result

    runner.execute = timed_execute
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch_size):
        llm.add_request([(7 * i + j) % 500 + 3 for j in range(prompt_len)], params)
    llm.step()  # the prefill step is not what we measure
    step_times = []
    forward_times.clear()
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        step_times.append(time.perf_counter() - start)
    llm.abort([str(i) for i in range(batch_size)])
    overhead = [s - f for s, f in zip(step_times, forward_times)]
    step = summarize(step_times)["p50"]
    rest = summarize(overhead)["p50"]
    return {"batch_size": batch_size, "step_ms_p50": step * 1e3, "execute_ms_p50": (step - rest) * 1e3,
            "overhead_ms_p50": rest * 1e3, "overhead_fraction": rest / step}


def profile_largest(model: str, batch_size: int, steps: int) -> str:
    """The functions where a steady decode step spends its time (cumulative), as text."""
    profiler = cProfile.Profile()
    profiler.enable()
    measure(model, batch_size, steps)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("cumulative")
    stats.print_stats(r"(llm_base|engine|scheduler|kv_cache_manager|block_pool|model_runner|output_processor|"
                      r"tokenizer|sampler|attention|model)\.py", 25)
    return out.getvalue()


def to_markdown(result: dict) -> str:
    lines = [
        "### Engine overhead per decode step",
        "",
        provenance(result, f"{result['config']['threads']} torch thread(s)") + "; model "
        f"`{result['config']['model']}`, stage4 engine, torch attention backend.",
        "",
        "| batch | step ms (p50) | model runner ms | everything else ms | overhead share |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['batch_size']} | {r['step_ms_p50']:.2f} | {r['execute_ms_p50']:.2f} | "
                     f"{r['overhead_ms_p50']:.2f} | {100 * r['overhead_fraction']:.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "engine_overhead")
    ap.add_argument("--model", default=None, help="checkpoint dir, or tiny / small (random llamas) / tiny-chat "
                    "(the small trained one) / default (SmolLM2-135M-Instruct); default: tiny")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also profile the largest batch")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model or "tiny")
    rows = [measure(model, b, args.steps) for b in args.batch_sizes]
    result = {**run_info("benchmarks.engine_overhead", argv),
              "config": {"model": Path(model).name, "threads": args.threads, "steps": args.steps}, "rows": rows}
    write_results("engine_overhead", result, to_markdown(result), args.out_dir, args.markdown)
    if args.profile:
        text = profile_largest(model, max(args.batch_sizes), args.steps)
        Path(args.markdown).with_name("engine_overhead_profile.txt").write_text(
            f"# {result['command']} ({result['date']})\n" + text)
    return result


if __name__ == "__main__":
    main()
