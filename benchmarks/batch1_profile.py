"""Where one decode token's time goes at batch 1, on stage5's CPU defaults and the default model.

One request (128 prompt tokens) is warmed up, then profiled twice with torch.profiler: generating
1 token (the prefill) and generating 17; the difference, divided by 16, is one decode token's
operators: how many calls of each and their self CPU time, largest first. Self times include the
profiler's own cost per call, so read the shares and the counts more than the milliseconds.

    python -m benchmarks.batch1_profile [--engine-args '{"quantization": "none"}']

It imports only the engine, so the same file run in an older checkout gives that commit's profile
(the "before" beside an "after").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

PROMPT_LEN, DECODE_TOKENS = 128, 16


def decode_token_operators(engine_args: dict) -> tuple[list[tuple[float, float, str]], str]:
    from shared import SamplingParams
    from stage5_server import LLM

    llm = LLM(device="cpu", enable_prefix_caching=False, seed=0, **engine_args)
    prompt = [100 + i for i in range(PROMPT_LEN)]

    def generate(n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.generate([prompt], params, use_tqdm=False)

    generate(8)
    totals = []
    for n in (1, DECODE_TOKENS + 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(n)
        totals.append({e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()})
    prefill, whole = totals
    rows = []
    for key, (count, self_us) in whole.items():
        count0, self0 = prefill.get(key, (0, 0))
        rows.append(((count - count0) / DECODE_TOKENS, (self_us - self0) / DECODE_TOKENS / 1e3, key))
    rows.sort(key=lambda r: -r[1])
    return rows, str(llm.dtype).removeprefix("torch.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-args", default="{}", help="JSON: LLM arguments beside the defaults")
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--out", default="docs/results/batch1_profile.txt")
    args = ap.parse_args(argv)
    rows, dtype = decode_token_operators(json.loads(args.engine_args))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    total_ms, total_calls = sum(r[1] for r in rows), sum(r[0] for r in rows)
    lines = [f"commit {commit or 'unknown'}, {platform.machine()}, {os.cpu_count()} CPUs, {dtype}, "
             f"engine arguments {args.engine_args}",
             f"one decode token at batch 1: {total_calls:.0f} operator calls, {total_ms:.2f} ms self CPU time",
             "",
             f"{'calls':>7} {'self ms':>8} {'share':>6}  operator"]
    for calls, ms, name in rows[:args.rows]:
        lines.append(f"{calls:7.0f} {ms:8.3f} {100 * ms / total_ms:5.1f}%  {name[:52]}")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
