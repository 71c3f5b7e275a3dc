"""``python -m stage5_server.inspector record``: record a run of any stage into a trace file the page replays.

    python -m stage5_server.inspector record --stage 4 --model tiny-chat \\
        --prompt "Name three colours." --prompt "Name three colours and a fruit." \\
        --max-tokens 24 --engine-arg block_size=4 --engine-arg num_kv_blocks=64 -o my_run.json

Then open the course's Watch page (or a server's ``/inspect``) and replay ``my_run.json`` there.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys

from shared.sampling_params import SamplingParams
from stage5_server.inspector.recorders import record

STAGES = {1: "stage1_naive", 2: "stage2_paged", 3: "stage3_continuous", 4: "stage4_prefix_cache", 5: "stage5_server"}


def engine_arg(text: str) -> tuple[str, object]:
    """``name=value``: the value as a Python literal where it is one (8, True, None, {...}), else the string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"engine-arg: expected NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stage5_server.inspector", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run prompts through a stage's LLM and write the trace")
    rec.add_argument("--stage", type=int, choices=sorted(STAGES), default=4)
    rec.add_argument("--model", default=None, help="a checkpoint directory or a name (default: the default model)")
    rec.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several requests)")
    rec.add_argument("--max-tokens", type=int, default=32)
    rec.add_argument("--temperature", type=float, default=0.0)
    rec.add_argument("--arrive-every", type=int, default=0, metavar="STEPS",
                     help="the prompts arrive this many steps apart (default: all at once)")
    rec.add_argument("--engine-arg", action="append", type=engine_arg, default=[], metavar="NAME=VALUE",
                     help="an engine argument of the stage's LLM, e.g. block_size=4 (repeat for several)")
    rec.add_argument("--clock", choices=("seconds", "steps"), default="seconds")
    rec.add_argument("--title", default="")
    rec.add_argument("-o", "--out", required=True, help="the trace file to write (.json)")
    args = parser.parse_args(argv)
    llm_class = importlib.import_module(STAGES[args.stage]).LLM
    try:
        llm = llm_class(args.model, **dict(args.engine_arg))
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    except ValueError as exc:  # an engine argument or a sampling parameter, named in the message
        parser.error(str(exc))
    try:
        trace = record(llm, args.prompt, params, arrivals=[i * args.arrive_every for i in range(len(args.prompt))],
                       title=args.title or f"{STAGES[args.stage]}: {len(args.prompt)} prompts", clock=args.clock)
    finally:
        if hasattr(llm, "shutdown"):
            llm.shutdown()
    path = trace.save(args.out)
    print(f"{path}: {len(trace.steps)} steps of {trace.engine}; replay it on the course's Watch page or a "
          "server's /inspect")
    return 0


if __name__ == "__main__":
    sys.exit(main())
