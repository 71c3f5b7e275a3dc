"""What recording every step costs: the offline batch-64 run of ``cpu_peers`` with the inspector off and on.

One engine (``cpu_peers.batch_engine``: the default model, stage 5's defaults, 64 requests at a time), the
same 64 requests (``cpu_roofline``'s workload), run with the engine core's ``inspector`` member None (off:
no record is built) and with a step observer (on: what ``enable_inspector=True`` builds), back to back,
``--repeats`` pairs, the order turned round in every other pair (off-on, on-off, ...), so that neither
always runs first and a change in the machine's load hits both. The report gives every run's seconds, the
medians and their ratio, the records built, and the time spent in the observer's two calls themselves
(timed around them: the part of the difference that is the inspector's own work, which the machine's
noise hides less than it hides a difference of two whole runs).

    python -m benchmarks.inspector_overhead [--repeats 3 --threads 2]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from benchmarks.cpu_peers import batch_engine, greedy
from benchmarks.cpu_roofline import make_workload


def timed_observer(scheduler):
    """The step observer ``enable_inspector`` builds, with the seconds spent in its two calls added up."""
    from stage5_server.inspector import StepObserver

    class TimedObserver(StepObserver):
        seconds = 0.0

        def scheduled(self, *args):
            start = time.perf_counter()
            super().scheduled(*args)
            self.seconds += time.perf_counter() - start

        def stepped(self, *args):
            start = time.perf_counter()
            super().stepped(*args)
            self.seconds += time.perf_counter() - start

    return TimedObserver.for_scheduler(scheduler, capacity=1 << 16)


def to_markdown(result: dict) -> str:
    config = result["config"]
    details = (f"{config['threads']} torch threads, load average {result['load_before']:.2f} before the run and "
               f"{result['load_after']:.2f} after, on a machine other jobs share")
    off, on = result["off_s"], result["on_s"]
    lines = ["### Recording every step: the batch-64 run with the inspector off and on", "",
             f"{provenance(result, details)}.", "",
             f"{config['num_requests']} requests, {config['output_tokens']} output tokens, "
             f"{result['steps_per_run']} engine steps a run; one engine, its inspector off and on, "
             f"{len(off)} pairs back to back, the order turned round in every other pair.", "",
             "| inspector | runs (s) | median (s) | output tokens/s |", "|---|---|---:|---:|"]
    for name, runs in (("off", off), ("on", on)):
        median = statistics.median(runs)
        lines.append(f"| {name} | {', '.join(f'{s:.2f}' for s in runs)} | {median:.2f} | "
                     f"{config['output_tokens'] / median:.0f} |")
    dropped = "none dropped" if not result["dropped"] else f"{result['dropped']} dropped"
    observer = result["observer_s"]
    share = statistics.median(o / t for o, t in zip(observer, on))
    lines += ["", f"On / off, medians: {statistics.median(on) / statistics.median(off):.3f}. "
              f"Records built with it on: one a step, {dropped}; with it off the core holds no observer.", "",
              f"Time in the observer's two calls, per run with it on: {', '.join(f'{s:.3f}' for s in observer)} s, "
              f"{1e3 * statistics.median(observer) / result['steps_per_run']:.2f} ms a step, "
              f"{100 * share:.2f}% of the run (median)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "inspector_overhead")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--model", default=None, help="default: the default model")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    llm = batch_engine(cpu_threads=args.threads, **({"model": args.model} if args.model else {}))
    engine = llm.engine
    prompts, outputs = make_workload(args.num_requests, 0, llm.model_config.vocab_size)
    params = [greedy(n) for n in outputs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    observer = timed_observer(engine.scheduler)
    times: dict[str, list[float]] = {"off": [], "on": []}
    records, dropped, observer_seconds = [], 0, []
    for pair in range(args.repeats):
        for name in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            engine.inspector = observer if name == "on" else None
            begin = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - begin)
            print(f"pair {pair + 1}, inspector {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
            if name == "on":
                drained = observer.drain()
                records.append(len(drained.records))
                dropped += drained.dropped
                observer_seconds.append(observer.seconds)
                observer.seconds = 0.0
    engine.inspector = None
    result = {**run_info("benchmarks.inspector_overhead", argv), "runtime_s": time.perf_counter() - started,
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "config": {"num_requests": args.num_requests, "output_tokens": sum(outputs), "threads": args.threads,
                         "repeats": args.repeats, "dtype": str(llm.dtype).removeprefix("torch.")},
              "off_s": times["off"], "on_s": times["on"], "steps_per_run": records[0], "dropped": dropped,
              "observer_s": observer_seconds}
    write_results("inspector_overhead", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
