"""stage5 on a CPU against the engines people pick instead, in one run, on the default model.

- batch 1: one request, the first ``--prompt-len`` tokens of a paragraph of English (repeated
  where it is shorter), ``--output-len`` tokens out (greedy, EOS ignored): output tokens/s over the
  whole request, prefill included, and TPOT (time per output token after the first);
- batch 64: ``benchmarks/cpu_roofline.py``'s workload (64 requests, prompts of tens to hundreds of
  tokens, 32 to 128 out): output tokens/s over the whole run.

Engines, one after the other:

- stage5 on its defaults (``LLM()``: on a CPU with native bfloat16, the GGUF file's 4-bit blocks
  for a few rows and packed bfloat16 weights for the rest, every step compiled),
  the same with every step eager (``enforce_eager=True``), stage5 bfloat16 on packed float weights
  (``quantization="none"``: a bfloat16 Hugging Face checkpoint's path, compiled), and stage5 float32, the
  reference;
- llama.cpp's ``llama-server`` on the same ``.gguf`` file (``STAGEDSERVE_LLAMA_SERVER=<path>``), one
  slot for batch 1 and 64 for batch 64, requests of token ids sent to ``/completion``;
- vLLM's CPU build (``STAGEDSERVE_VLLM_PYTHON=<venv>/bin/python``, ``benchmarks/vllm_peer.py``) on the
  dequantized checkpoint, bfloat16 and float32.

Every engine gets the same threads (``--threads``, default: the CPUs). In the same run, two rooflines
of the batch-64 workload in each float dtype, over an ideal schedule of its steps: "linear",
``cpu_roofline.py``'s, torch's ``linear`` timed at the model's shapes; and "machine",
``machine_roofline.py``'s, the products' FLOPs at the machine's measured peak (a hand-timed vector
FMA loop, or a large GEMM where a library reaches matrix units) or the weights read once a step at
its read bandwidth, whichever is longer. "of ... roofline" is that time over the engine's. The last column is how
many of the batch-1 request's greedy tokens match stage5 float32's before the first difference: a
sanity check across engines; closeness proper is ``benchmarks/linear_methods.py``'s.

    STAGEDSERVE_LLAMA_SERVER=... STAGEDSERVE_VLLM_PYTHON=... python -m benchmarks.cpu_peers
"""

from __future__ import annotations

import gc
import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from benchmarks import machine_roofline
from benchmarks.api_oracle import free_port, server
from benchmarks.common import benchmark_parser, provenance, run_info, save_figure, write_results
from benchmarks.cpu_roofline import DTYPES, gemm_times, ideal_schedule, make_workload, roofline_seconds, run_vllm
from shared import SamplingParams
from shared.tokenizer import Tokenizer

STAGE5_ROWS = {  # label -> engine arguments
    "stage5 defaults": {},
    "stage5 defaults, eager": dict(enforce_eager=True),
    "stage5 bf16 packed": dict(dtype="bfloat16", quantization="none"),
    "stage5 float32": dict(dtype="float32"),
}
BATCH1_TEXT = (
    "A serving engine keeps the keys and values of every token it has seen, so that each new token "
    "attends to them without recomputing the past. Early engines reserved one long buffer per request, "
    "sized for the longest answer it might give, and most of that memory sat empty. Paging cuts the "
    "cache into small fixed blocks and hands a request a new block only when the last one fills, the "
    "way an operating system maps virtual pages to physical frames. A table per request lists its "
    "blocks in order. With memory no longer wasted, many more requests fit in one batch, and the "
    "scheduler can add a request the moment another finishes instead of waiting for the whole batch. "
)
BATCH = dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)  # cpu_roofline's settings


def greedy(max_tokens: int, **fields) -> SamplingParams:
    """What every engine here is asked: greedy, ``max_tokens`` with EOS ignored, no text."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **fields)


def batch_engine(**engine_args):
    """stage5 with the batch settings (``BATCH``, no prefix caching): ``LLM()`` defaults unless
    ``engine_args`` say otherwise."""
    from stage5_server import LLM

    return LLM(device="cpu", enable_prefix_caching=False, seed=0, **BATCH, **engine_args)


def run_stage5(engine_args: dict, one: list[int], output_len: int, prompts, outputs) -> dict:
    start = time.perf_counter()
    llm = batch_engine(**engine_args)
    llm.generate([one[:16], one[:8]], greedy(4), use_tqdm=False)  # warm-up: one row and two
    load = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([one], greedy(1), use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    [out] = llm.generate([one], greedy(output_len), use_tqdm=False)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, [greedy(n) for n in outputs], use_tqdm=False)
    batch = time.perf_counter() - start
    dtype = str(llm.dtype).removeprefix("torch.")
    del llm
    gc.collect()
    return {"dtype": dtype, "load_s": load, "batch1_s": whole, "tpot_ms": (whole - first) / (output_len - 1) * 1e3,
            "batch_s": batch, "tokens": list(out.outputs[0].token_ids)}


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def _completion(url: str, prompt: list[int], n: int) -> dict:
    return _post(f"{url}/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                                       "ignore_eos": True, "cache_prompt": False, "return_tokens": True})


def llama_server(binary: str, gguf: str, slots: int, context_per_slot: int, threads: int) -> tuple[list[str], str]:
    """``llama-server`` on the GGUF file, ``slots`` requests at once: its command and its URL."""
    port = free_port()
    return [binary, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(slots * context_per_slot)], f"http://127.0.0.1:{port}"


def run_llama_cpp(binary: str, gguf: str, one: list[int], output_len: int, prompts, outputs, threads: int) -> dict:
    command, url = llama_server(binary, gguf, 1, len(one) + output_len + 16, threads)
    with server(command, url, dict(os.environ), 300):
        _completion(url, one[:16], 4)  # warm-up
        start = time.perf_counter()
        reply = _completion(url, one, output_len)
        whole = time.perf_counter() - start
    timings = reply["timings"]
    longest = max(len(p) + n for p, n in zip(prompts, outputs))
    command, url = llama_server(binary, gguf, len(prompts), longest + 16, threads)
    with server(command, url, dict(os.environ), 300):
        _completion(url, prompts[0][:16], 4)
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda pn: _completion(url, *pn), zip(prompts, outputs)))
        batch = time.perf_counter() - start
    if sum(r["timings"]["predicted_n"] for r in replies) != sum(outputs):
        raise RuntimeError("llama-server generated a different number of tokens than asked")
    return {"dtype": "gguf", "batch1_s": whole, "tpot_ms": timings["predicted_ms"] / timings["predicted_n"],
            "batch_s": batch,
            "tokens": reply.get("tokens", [])}


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


RATIOS = {  # label -> (stage5 row, peer row, column): each peer against stage5 in the same dtype; N: the batch
    "batch 1, stage5 defaults / llama.cpp": ("stage5 defaults", "llama.cpp (same GGUF)", "batch1_tokens_per_s"),
    "batch N, stage5 defaults (bfloat16) / vLLM bfloat16": ("stage5 defaults", "vLLM bfloat16",
                                                             "batch_tokens_per_s"),
    "batch N, stage5 float32 / vLLM float32": ("stage5 float32", "vLLM float32", "batch_tokens_per_s"),
}


def peer_ratios(rows: dict) -> dict:
    return {label: rows[ours][key] / rows[peer][key] for label, (ours, peer, key) in RATIOS.items()
            if ours in rows and peer in rows}


def to_markdown(result: dict) -> str:
    rows, cfg = result["rows"], result["config"]
    load = result["load_average"]
    details = f"{cfg['threads']} threads per engine, load average {load['before'][0]:.2f} before, " \
              f"{load['after'][0]:.2f} after"
    lines = [
        "### stage5 against llama.cpp and vLLM on a CPU (default model)",
        "",
        f"{provenance(result, details)}.",
        "",
        f"Batch 1: one request, {cfg['prompt_len']} prompt tokens of English, {cfg['output_len']} out. Batch "
        f"{cfg['num_requests']}: {cfg['num_requests']} requests, {cfg['batch_output_tokens']} output tokens "
        "in all (`cpu_roofline`'s workload).",
        "",
        "Rooflines of the batch workload: the products at their shapes through torch's `linear` (\"linear\"): "
        + ", ".join(f"{dtype} {r['seconds']:.2f} s" for dtype, r in result["roofline"].items())
        + "; the products at the machine's measured limits (\"machine\": "
        + machine_roofline.describe(result["machine_peaks"]) + "): "
        + ", ".join(f"{dtype} {r['machine_seconds']:.2f} s" for dtype, r in result["roofline"].items()) + ".",
        "",
        f"| engine | batch 1 tok/s | TPOT ms | batch {cfg['num_requests']} tok/s | of linear roofline "
        "| of machine roofline | same tokens as fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        tpot = f"{r['tpot_ms']:.1f}" if r.get("tpot_ms") else "n/a"
        roof = f"{100 * r['of_roofline']:.0f}%" if r.get("of_roofline") else "n/a"
        machine = f"{100 * r['of_machine']:.0f}%" if r.get("of_machine") else "n/a"
        lines.append(f"| {label} | {r['batch1_tokens_per_s']:.1f} | {tpot} | {r['batch_tokens_per_s']:.0f} | "
                     f"{roof} | {machine} | {r['matching_prefix']}/{cfg['output_len']} |")
    for label, why in result["skipped"].items():
        lines.append(f"| {label} | not run: {why[:60]} | | | | | |")
    ratios, batch = result["ratios"], f"batch {cfg['num_requests']}"
    if ratios:
        lines += ["", "Ratios (same run): "
                  + "; ".join(f"{k.replace('batch N', batch)} {v:.2f}x" for k, v in ratios.items()) + "."]
    lines += ["", "![stage5, llama.cpp and vLLM at batch 1 and batch 64](assets/cpu_peers.png)"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, n = result["rows"], result["config"]["num_requests"]
    labels = list(rows)
    colors = ["#264653" if label.startswith("stage5") else "#e76f51" for label in labels]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "batch1_tokens_per_s", "batch 1 (one request)"),
                           (axes[1], "batch_tokens_per_s", f"batch {n}")):
        ax.bar(range(len(labels)), [rows[label][key] for label in labels], color=colors)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("output tokens / s")
        ax.set_title(title, fontsize=9)
    for dtype, style in (("float32", "--"), ("bfloat16", ":")):
        if dtype in result["roofline"]:
            roof = result["config"]["batch_output_tokens"] / result["roofline"][dtype]["seconds"]
            axes[1].axhline(roof, linestyle=style, color="gray", label=f"roofline {dtype}")
    axes[1].legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from shared.config import ModelConfig
    from shared.named_models import default_model, default_model_file

    ap = benchmark_parser(__doc__, "cpu_peers", plot=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peak-gemm-size", type=int, default=4096,
                    help="the square GEMM that measures the machine's peak (smaller: quicker, lower peak)")
    ap.add_argument("--llama-server", default=os.environ.get("STAGEDSERVE_LLAMA_SERVER"))
    ap.add_argument("--vllm-python", default=os.environ.get("STAGEDSERVE_VLLM_PYTHON"))
    ap.add_argument("--rows", nargs="+", default=list(STAGE5_ROWS), choices=list(STAGE5_ROWS))
    args = ap.parse_args(argv)
    started = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model, gguf = default_model(), str(default_model_file())
    model_config = ModelConfig.from_pretrained(model)
    vocab = model_config.vocab_size
    text_ids = Tokenizer(model).encode(BATCH1_TEXT)
    one = (text_ids * (args.prompt_len // len(text_ids) + 1))[:args.prompt_len]
    prompts, outputs = make_workload(args.num_requests, 0, vocab)
    result = {**run_info("benchmarks.cpu_peers", argv), "load_average": {"before": os.getloadavg()},
              "config": {"prompt_len": args.prompt_len, "output_len": args.output_len,
                         "num_requests": args.num_requests, "batch_output_tokens": sum(outputs),
                         "threads": args.threads}, "rows": {}, "skipped": {}}
    steps = ideal_schedule(list(map(len, prompts)), outputs, BATCH["max_num_seqs"], BATCH["max_num_batched_tokens"])
    torch.set_num_threads(args.threads)
    result["machine_peaks"] = machine = machine_roofline.measure(args.threads, args.peak_gemm_size)
    result["roofline"] = {}
    for name, dtype in DTYPES.items():  # machine: the larger of the vector loop's and the GEMM's peak
        peak = max(machine["fma_float32_gflops"] or 0.0, machine["gemm_gflops"][name])
        result["roofline"][name] = {
            "seconds": roofline_seconds(gemm_times(model_config, dtype), steps),
            "machine_seconds": machine_roofline.products_floor_seconds(model_config, steps, peak,
                                                                       machine["read_gb_s"] * 1e9, dtype.itemsize)}
    runs = {label: (lambda a=STAGE5_ROWS[label]: run_stage5({**a, "cpu_threads": args.threads}, one,
                                                           args.output_len, prompts, outputs)) for label in args.rows}
    if args.llama_server:
        runs["llama.cpp (same GGUF)"] = lambda: run_llama_cpp(args.llama_server, gguf, one, args.output_len,
                                                              prompts, outputs, args.threads)
    else:
        result["skipped"]["llama.cpp"] = "set STAGEDSERVE_LLAMA_SERVER"
    for dtype in ("bfloat16", "float32") if args.vllm_python else ():
        runs[f"vLLM {dtype}"] = lambda d=dtype: run_vllm_rows(args, model, d, one, prompts, outputs)
    if not args.vllm_python:
        result["skipped"]["vLLM"] = "set STAGEDSERVE_VLLM_PYTHON"
    for label, run in runs.items():
        try:
            row = run()
        except Exception as exc:  # a peer that fails to start is reported, not fatal
            result["skipped"][label] = f"{type(exc).__name__}: {exc}"[:800]
            continue
        row["batch1_tokens_per_s"] = args.output_len / row["batch1_s"]
        row["batch_tokens_per_s"] = sum(outputs) / row["batch_s"]
        if row["dtype"] in result["roofline"]:
            row["of_roofline"] = result["roofline"][row["dtype"]]["seconds"] / row["batch_s"]
            row["of_machine"] = result["roofline"][row["dtype"]]["machine_seconds"] / row["batch_s"]
        result["rows"][label] = row
        print(f"{label}: {row['batch1_tokens_per_s']:.1f} tok/s at batch 1, {row['batch_tokens_per_s']:.0f} at "
              f"batch {args.num_requests}", flush=True)
    reference = result["rows"].get("stage5 float32", {}).get("tokens", [])
    for row in result["rows"].values():
        row["matching_prefix"] = matching_prefix(reference, row.pop("tokens"))
    result["ratios"] = peer_ratios(result["rows"])
    result["load_average"]["after"] = os.getloadavg()
    result["runtime_s"] = time.perf_counter() - started
    write_results("cpu_peers", result, to_markdown(result), args.out_dir, args.markdown)
    plot(result, args.plot)
    return result


def run_vllm_rows(args, model: str, dtype: str, one, prompts, outputs) -> dict:
    settings = SimpleNamespace(max_num_seqs=BATCH["max_num_seqs"], max_model_len=BATCH["max_model_len"],
                               max_num_batched_tokens=BATCH["max_num_batched_tokens"], check_requests=1,
                               threads=args.threads)
    single = run_vllm(args.vllm_python, model, dtype, [one], [args.output_len], settings)
    batch = run_vllm(args.vllm_python, model, dtype, prompts, outputs, settings)
    return {"dtype": dtype, "batch1_s": single["wall_s"], "batch_s": batch["wall_s"],
            "tokens": single["token_ids"][0]}


if __name__ == "__main__":
    main()
