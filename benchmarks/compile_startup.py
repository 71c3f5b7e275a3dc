"""Start-up with the compiled step: cold (an empty inductor cache), warm (the cache of the cold start) and
eager, on the default model and on it as a bfloat16 Hugging Face directory.

Each start is a fresh process (``python -c``) that builds ``LLM(model, **engine args)`` and answers one
request of 16 tokens; the seconds are that process's whole life, imports included, and the engine's own
compile time from its log line. Cold and warm share an inductor cache directory made for the run
(``TORCHINDUCTOR_CACHE_DIR``), so the machine's own cache plays no part. The compiled step runs on the CPU
fast path (bfloat16); ``--dtype bfloat16`` asks for it where ``auto`` would pick float32 (a CPU without
native bfloat16), ``--dtype auto`` keeps each engine's choice.

    python -m benchmarks.compile_startup [--models default bf16] [--dtype bfloat16]

Writes ``benchmarks/results/compile_startup.json`` and ``docs/results/compile_startup.md``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import benchmark_parser, bf16_checkpoint, provenance, run_info, write_results

NAME = "compile_startup"
START = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from shared import SamplingParams
from stage5_server import LLM
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
llm.generate([[1] * 16], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
print("dtype", llm.dtype)
"""
COMPILED = re.compile(r"compiled step: (.*); compiled in ([0-9.]+) s")


def start(model: str, engine_args: dict, cache_dir: str) -> dict:
    """One start in a fresh process: its seconds, and what its log says of the compiled step."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", START, model, json.dumps(engine_args)], capture_output=True,
                          text=True, env=env)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    compiled = COMPILED.search(done.stderr)
    return {"seconds": seconds, "compile_s": float(compiled.group(2)) if compiled else None,
            "graphs": compiled.group(1) if compiled else None,
            "dtype": done.stdout.split("dtype", 1)[1].strip()}


def to_markdown(result: dict) -> str:
    load = f"load average {result['load_average']:.2f} before"
    lines = [f"{provenance(result, load)}.", "",
             "Seconds from a fresh process to one answered request (imports, loading, compiling, 16 tokens); "
             "in brackets, the engine's compile alone.", "",
             "| model | dtype | eager | compiled, cold cache | compiled, warm cache | warm / eager |",
             "|---|---|---:|---:|---:|---:|"]
    for label, row in result["rows"].items():
        cells = [f"{row[k]['seconds']:.1f}" + (f" ({row[k]['compile_s']:.1f})" if row[k]["compile_s"] else "")
                 for k in ("eager", "cold", "warm")]
        lines.append(f"| {label} | {row['eager']['dtype']} | " + " | ".join(cells)
                     + f" | {row['warm']['seconds'] / row['eager']['seconds']:.2f}x |")
    graphs = {row["cold"]["graphs"] for row in result["rows"].values() if row["cold"]["graphs"]}
    lines += ["", "Graphs: " + "; ".join(sorted(graphs)) + "."] if graphs else []
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from shared.named_models import default_model

    ap = benchmark_parser(__doc__, NAME)
    ap.add_argument("--models", nargs="+", default=["default", "bf16"],
                    help="default (the GGUF file), bf16 (it as a bfloat16 directory), or directories")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    result = {**run_info(f"benchmarks.{NAME}", argv), "load_average": os.getloadavg()[0],
              "config": {"models": args.models, "dtype": args.dtype}, "rows": {}}
    for name in args.models:
        model = {"default": "default", "bf16": bf16_checkpoint(default_model())}.get(name, name)
        label = {"default": "default (GGUF file)", "bf16": "default as a bfloat16 directory"}.get(name, name)
        with tempfile.TemporaryDirectory() as cache:
            row = {"eager": start(model, {"dtype": args.dtype, "enforce_eager": True}, cache)}
            for kind in ("cold", "warm"):
                row[kind] = start(model, {"dtype": args.dtype}, cache)
        result["rows"][label] = row
        print(label, json.dumps(row), flush=True)
    result["runtime_s"] = time.perf_counter() - started
    write_results(NAME, result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
