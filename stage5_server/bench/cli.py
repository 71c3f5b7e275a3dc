"""``stagedserve bench serve|sweep``: the argument parsers and the two commands.

    stagedserve bench serve --base-url http://127.0.0.1:8000 --api-key KEY --dataset random \\
        --num-prompts 200 --request-rate 4 --slo-ttft-ms 300 --slo-itl-p99-ms 50 \\
        --save-result run.json --plot run.png
    stagedserve bench sweep [--model DIR] --request-rates 1 2 4 inf \\
        --max-num-batched-tokens 256 2048 --max-num-seqs 16 --slo-ttft-ms 300 ...

``sweep`` starts the server in-process once per scheduler setting (``create_app`` over a
fresh ``LLM``, uvicorn on a free loopback port in a thread), runs ``serve`` at every rate
against it, and prints the goodput curve: a larger token budget is worth keeping only if
it raises goodput on the same workload.

``stage5_server/cli.py`` calls ``add_bench_subcommands(subparsers)``; each parser sets
``func`` to a handler ``(args) -> int`` (the exit code).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import secrets
import sys
import time
from typing import Any

from stage5_server.arg_types import non_negative_float, non_negative_int, positive_float, positive_int
from stage5_server.bench.datasets import DATASETS, DatasetConfig
from stage5_server.bench.goodput import SLO
from stage5_server.bench.report import format_result, format_sweep_table, plot_results, save_result, summarize_run
from stage5_server.bench.serve import ServeConfig, run_serve


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (a number of req/s, or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 (or inf), got {text!r}")
    return value










def _add_load_args(p: argparse.ArgumentParser) -> None:
    load = p.add_argument_group("load")
    load.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                      help="/v1/completions (token-id prompts sent as ids) or /v1/chat/completions")
    load.add_argument("--max-concurrency", type=positive_int, default=None,
                      help="at most this many requests in flight (default: unbounded)")
    load.add_argument("--warmup-requests", type=non_negative_int, default=0,
                      help="send this many warm-up requests first (not counted)")
    load.add_argument("--warmup-seconds", type=non_negative_float, default=0.0,
                      help="requests sent in the first S seconds are warm-up (not counted)")
    load.add_argument("--window-seconds", type=positive_float, default=None,
                      help="fixed measured window; requests unfinished at its end are outstanding "
                           "(default: until the last measured request ends)")
    load.add_argument("--request-timeout", type=positive_float, default=600.0,
                      help="a request still running after this many seconds fails (default: 600)")
    load.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival gaps")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                      help="let outputs stop at EOS (default: ignore_eos, so lengths follow the dataset)")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", default=None, help="json dataset: a list of strings or of "
                                                           '{"prompt", "max_tokens"}')
    data.add_argument("--num-prompts", type=positive_int, default=None,
                      help="measured requests (default: 100; 22 for two-phase; the whole file for json)")
    data.add_argument("--max-tokens", type=positive_int, default=None, help="override every output budget")
    data.add_argument("--vocab-size", type=positive_int, default=256,
                      help="random token ids are drawn from [3, VOCAB_SIZE) (default 256: byte tokens)")
    data.add_argument("--prompt-len", type=positive_int, default=100, help="random: median prompt tokens")
    data.add_argument("--output-len", type=positive_int, default=200, help="random: median output tokens")
    data.add_argument("--len-sigma", type=float, default=1.0, help="random: log-normal sigma of both lengths")
    data.add_argument("--max-prompt-len", type=positive_int, default=1024)
    data.add_argument("--max-output-len", type=positive_int, default=1024)
    data.add_argument("--prefix-len", type=positive_int, default=384,
                      help="shared-prefix / two-phase: shared system prompt tokens")
    data.add_argument("--num-prefixes", type=positive_int, default=1,
                      help="shared-prefix: distinct shared prefixes, the requests spread over them (default: 1)")
    data.add_argument("--long-prompt-len", type=positive_int, default=1024, help="two-phase: long prompt tokens")
    data.add_argument("--phase-gap-seconds", type=non_negative_float, default=1.0,
                      help="two-phase: pause between phase 1 draining and phase 2")
    slo = p.add_argument_group("SLOs (a completion passes only if it meets every one given)")
    slo.add_argument("--slo-ttft-ms", type=positive_float, default=None)
    slo.add_argument("--slo-itl-p99-ms", type=positive_float, default=None,
                     help="the p99 of each request's own inter-token gaps")
    slo.add_argument("--slo-tpot-ms", type=positive_float, default=None)
    out = p.add_argument_group("output")
    out.add_argument("--save-result", default=None, metavar="FILE.json",
                     help="all numbers, the config, the date and every request's timeline")
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="latency CDFs (TTFT, ITL, E2E); goodput vs request rate when several rates ran")


def add_bench_subcommands(subparsers) -> None:
    """Add ``bench`` with ``serve`` and ``sweep`` to the ``stagedserve`` parser."""
    bench = subparsers.add_parser("bench", help="benchmark a server: latency, throughput, goodput under SLOs")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND")

    s = sub.add_parser("serve", help="load a running OpenAI-compatible server and report goodput",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $OPENAI_API_KEY)")
    s.add_argument("--model", default=None, help="model name to send (default: the first the server lists)")
    s.add_argument("--request-rate", type=_rate, nargs="+", default=[math.inf],
                   help="req/s of Poisson arrivals, or inf for a burst; several values run one after another")
    _add_load_args(s)
    s.set_defaults(func=bench_serve)

    w = sub.add_parser("sweep", help="start the server in-process per scheduler setting; goodput vs rate",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w.add_argument("--model", default=None, help="model directory, .gguf file or name (default: SmolLM2-135M-Instruct)")
    w.add_argument("--request-rates", "--request-rate", dest="request_rate", type=_rate, nargs="+",
                   default=[1.0, 4.0, math.inf])
    w.add_argument("--max-num-batched-tokens", type=positive_int, nargs="+", default=[256, 2048],
                   help="token budgets per step to compare")
    w.add_argument("--max-num-seqs", type=positive_int, nargs="+", default=[16], help="running-set caps")
    eng = w.add_argument_group("engine (same for every setting)")
    eng.add_argument("--max-model-len", type=positive_int, default=None)
    eng.add_argument("--block-size", type=positive_int, default=None)
    eng.add_argument("--num-kv-blocks", type=positive_int, default=None)
    eng.add_argument("--device", default=None)
    eng.add_argument("--dtype", default=None)
    eng.add_argument("--attention-backend", default=None)
    eng.add_argument("--engine-seed", type=int, default=0)
    _add_load_args(w)
    w.set_defaults(func=bench_sweep)


def _serve_config(args: argparse.Namespace, base_url: str, api_key: str | None, model: str | None,
                  rate: float) -> ServeConfig:
    dataset = DatasetConfig(
        name=args.dataset, num_prompts=args.num_prompts, seed=args.seed, vocab_size=args.vocab_size,
        max_tokens=args.max_tokens, prompt_len=args.prompt_len, output_len=args.output_len, len_sigma=args.len_sigma,
        max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, long_prompt_len=args.long_prompt_len, path=args.dataset_path)
    return ServeConfig(
        base_url=base_url, api_key=api_key, model=model, endpoint=args.endpoint, request_rate=rate,
        max_concurrency=args.max_concurrency, warmup_requests=args.warmup_requests,
        warmup_seconds=args.warmup_seconds, window_seconds=args.window_seconds, request_timeout=args.request_timeout,
        seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos,
        phase_gap_seconds=args.phase_gap_seconds,
        slo=SLO(args.slo_ttft_ms, args.slo_itl_p99_ms, args.slo_tpot_ms), dataset=dataset)


def _finish(args: argparse.Namespace, rows: list[dict[str, Any]], command: str, extra: dict | None = None) -> None:
    if args.save_result:
        save_result(args.save_result, {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       **(extra or {}),
                                       "runs": [{"setting_label": r.get("setting"), **r["result"]} for r in rows]})
        print(f"saved {args.save_result}")
    if args.plot:
        plot_results(rows, args.plot, title=command)
        print(f"saved {args.plot}")


def _command_line() -> str:
    return "stagedserve " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "stagedserve bench"


def bench_serve(args: argparse.Namespace) -> int:
    rows = []
    try:
        for rate in args.request_rate:
            run = run_serve(_serve_config(args, args.base_url, args.api_key, args.model, rate))
            res = summarize_run(run)
            print(format_result(res), flush=True)
            rows.append({"result": res})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(rows) > 1:
        print(format_sweep_table(rows))
    _finish(args, rows, _command_line())
    return 0


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("max_model_len", "block_size", "num_kv_blocks", "device", "dtype", "attention_backend")
    kwargs = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    kwargs["seed"] = args.engine_seed
    return kwargs


def bench_sweep(args: argparse.Namespace) -> int:
    """Per (max_num_batched_tokens, max_num_seqs): a fresh engine and server, every rate, then stop it."""
    from shared import default_model
    from stage5_server.llm import LLM
    from stage5_server.server import ServerThread, create_app

    model = args.model or str(default_model())
    api_key = secrets.token_urlsafe(24)  # the in-process server is on loopback, and still needs a key
    rows: list[dict[str, Any]] = []
    try:
        for budget, seqs in itertools.product(args.max_num_batched_tokens, args.max_num_seqs):
            setting = f"tokens={budget} seqs={seqs}"
            print(f"--- {setting}: starting the server in-process", flush=True)
            llm = LLM(model, max_num_batched_tokens=budget, max_num_seqs=seqs, **_engine_kwargs(args))
            app = create_app(llm, api_keys=[api_key], served_model_name="bench", log_stats_interval=None)
            with ServerThread(app, host="127.0.0.1", port=0) as server:
                for rate in args.request_rate:
                    run = run_serve(_serve_config(args, server.url, api_key, "bench", rate))
                    res = summarize_run(run)
                    res["setting"] = {"max_num_batched_tokens": budget, "max_num_seqs": seqs}
                    print(format_result(res), flush=True)
                    rows.append({"setting": setting, "result": res})
            del app, llm
            gc.collect()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\nGoodput curve: passing completions per second of window\n"
          f"SLO: {rows[0]['result']['slo_text'] if rows else '-'}")
    print(format_sweep_table(rows))
    print(_verdict(rows))
    _finish(args, rows, _command_line(), {"model": model, "engine": _engine_kwargs(args)})
    return 0


def _verdict(rows: list[dict[str, Any]]) -> str:
    """Which setting has the highest goodput at each rate (ties: the first listed, the smaller budget)."""
    by_rate: dict[float, list[tuple[float, str]]] = {}
    for row in rows:
        res = row["result"]
        g = res["goodput_req_s"]
        by_rate.setdefault(res["config"]["request_rate"], []).append((-1.0 if math.isnan(g) else g, row["setting"]))
    wins: dict[str, int] = {}
    lines = []
    for rate, entries in by_rate.items():
        best = max(entries, key=lambda e: e[0])  # max keeps the first of equals
        label = "inf" if math.isinf(rate) else format(rate, "g")
        if best[0] <= 0:  # nothing met the SLO: no setting wins, the rate is past what any can serve
            lines.append(f"  rate {label}: no setting met the SLO (overloaded)")
            continue
        wins[best[1]] = wins.get(best[1], 0) + 1
        lines.append(f"  rate {'inf' if math.isinf(rate) else format(rate, 'g')}: best goodput {best[0]:.2f}/s "
                     f"with {best[1]}")
    overall = max(wins, key=wins.get) if wins else "-"
    return ("Keep a larger token budget only where it raises goodput:\n" + "\n".join(lines)
            + f"\n  => {overall} wins at {wins.get(overall, 0)} of {len(by_rate)} rate(s)")


def main(argv: list[str] | None = None) -> int:
    """``python -m stage5_server.bench.cli serve|sweep ...`` (the same as ``stagedserve bench``)."""
    parser = argparse.ArgumentParser(prog="stagedserve")
    add_bench_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
