"""Stage 5's linear methods on the default model, on a CPU: speed at batch 1 and 64, and closeness.

The same engine (``LLM(device="cpu", dtype="bfloat16")``) with each way its linear layers can
run (``stage5_server/quantization/``): the dequantized bfloat16 weights through ``F.linear``,
the same weights packed once for oneDNN (``prepack_linear=True``), weight-only int8 quantized
from them (``quantization="int8"``), and the GGUF file's own Q4_1 blocks as int4
(``quantization="gguf"``; its Q8_0 embedding, which the LM head shares, as per-row int8), and those
blocks for products of a few rows beside the packed weights for the rest (both arguments; the
default on a CPU in bfloat16). Per row:

- batch 1: one request, a prompt of ``--prompt-len`` random tokens, ``--output-len`` tokens out
  (greedy, EOS ignored): output tokens/s, and TPOT (that run's time less a one-token run's time,
  over the tokens after the first);
- batch 64: 64 such requests at once, ``--batch-output-len`` tokens each: output tokens/s over
  the whole run, prefill included;
- closeness (``shared/closeness.py``, vLLM's ``check_logprobs_close``): a few English prompts,
  greedy with top-5 logprobs, against the float32 dequantized model (``F.linear``, the
  correctness reference); each engine's token must be in the other's top 5 where they first differ.

The load average is recorded before and after: on a shared machine read the ratios of one run.

    python -m benchmarks.linear_methods [--output-len 256 --batch-output-len 32]
"""

from __future__ import annotations

import gc
import os
import time

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams
from shared.closeness import as_token_logprobs, first_divergences

ROWS = {  # label -> engine arguments
    "bf16 plain": dict(dtype="bfloat16", quantization="none", prepack_linear=False),
    "bf16 packed": dict(dtype="bfloat16", quantization="none", prepack_linear=True),
    "int8 (from bf16)": dict(dtype="bfloat16", quantization="int8", prepack_linear=False),
    "int4 (GGUF Q4_1)": dict(dtype="bfloat16", quantization="gguf", prepack_linear=False),
    "int4 (GGUF) + packed": dict(dtype="bfloat16", quantization="gguf", prepack_linear=True),
}
REFERENCE = dict(dtype="float32", quantization="none", prepack_linear=False)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "My favourite book is"]


def _engine(model, engine_args: dict, max_num_seqs: int):
    from stage5_server import LLM

    return LLM(model=model, device="cpu", max_model_len=1024, max_num_seqs=max_num_seqs, enable_prefix_caching=False,
               seed=0, **engine_args)


def _check(llm, max_tokens: int) -> dict:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5), use_tqdm=False)
    return {"ids": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [as_token_logprobs(o.outputs[0].logprobs) for o in outs]}


def _timed_generate(llm, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def run_row(model, engine_args: dict, args, prompts: list[list[int]], reference: dict | None) -> dict:
    start = time.perf_counter()
    llm = _engine(model, engine_args, max_num_seqs=args.batch_size)
    load = time.perf_counter() - start
    _timed_generate(llm, [prompts[0][:16], prompts[1][:16]], 4)  # warm-up: a batch of one and of two
    _timed_generate(llm, [prompts[0][:16]], 4)
    first = _timed_generate(llm, prompts[:1], 1)
    whole = _timed_generate(llm, prompts[:1], args.output_len)
    batch = _timed_generate(llm, prompts[:args.batch_size], args.batch_output_len)
    check = _check(llm, args.check_tokens)
    row = {"engine_args": engine_args, "load_s": load, "batch1_s": whole, "batch1_first_token_s": first,
           "batch1_tokens_per_s": args.output_len / whole,
           "tpot_ms": (whole - first) / (args.output_len - 1) * 1e3,
           "batch_s": batch, "batch_tokens_per_s": args.batch_size * args.batch_output_len / batch, **check}
    if reference is not None:
        found = first_divergences(reference["ids"], reference["logprobs"], check["ids"], check["logprobs"])
        row["identical"] = len(PROMPTS) - len(found)
        row["close"] = all(d.close for d in found)
        row["first_divergence"] = min((d.position for d in found), default=None)
    del llm
    gc.collect()
    return row


def to_markdown(result: dict) -> str:
    rows, base = result["rows"], result["rows"]["bf16 plain"]
    load = result["load_average"]
    details = f"load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after"
    n = len(PROMPTS)
    lines = [
        "### The default model's linear layers on a CPU (bfloat16 activations)",
        "",
        f"{provenance(result, details)}.",
        "",
        f"Batch 1: one request, {result['prompt_len']} prompt tokens, {result['output_len']} out. Batch "
        f"{result['batch_size']}: {result['batch_size']} such requests, {result['batch_output_len']} tokens out "
        f"each. Closeness: {n} prompts, {result['check_tokens']} greedy tokens, against the float32 "
        "dequantized model.",
        "",
        f"| linear layers | weights MiB | batch 1 tok/s | TPOT ms | vs plain | batch {result['batch_size']} tok/s "
        "| vs plain | identical | close |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['weight_mib']:.0f} | {r['batch1_tokens_per_s']:.1f} | {r['tpot_ms']:.1f} | "
            f"{r['batch1_tokens_per_s'] / base['batch1_tokens_per_s']:.2f}x | {r['batch_tokens_per_s']:.0f} | "
            f"{r['batch_tokens_per_s'] / base['batch_tokens_per_s']:.2f}x | {r['identical']}/{n} | "
            f"{'yes' if r['close'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _weight_mib(engine_args: dict) -> float:
    """What the start-up log states: the model's linear weights as its methods hold them."""
    from shared import default_model
    from shared.weights import load_model
    from stage5_server.config import EngineConfig
    from stage5_server.model import fuse_projections
    from stage5_server.quantization import install_linear_methods

    config = EngineConfig.create(None, device="cpu", **engine_args)
    model = fuse_projections(load_model(default_model(), config.dtype, "cpu")[0])
    line = install_linear_methods(model, config.linear)
    return float(line.rsplit("; ", 1)[1].split(" MiB")[0])


def main(argv: list[str] | None = None) -> dict:
    import random

    ap = benchmark_parser(__doc__, "linear_methods")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--batch-output-len", type=int, default=32)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--model", default=None, help="default: the default model (its GGUF file)")
    args = ap.parse_args(argv)
    result = {**run_info("benchmarks.linear_methods", argv), "load_average": {"before": os.getloadavg()},
              "prompt_len": args.prompt_len, "output_len": args.output_len, "batch_size": args.batch_size,
              "batch_output_len": args.batch_output_len, "check_tokens": args.check_tokens, "rows": {}}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch_size)]
    reference_llm = _engine(args.model, REFERENCE, max_num_seqs=len(PROMPTS))
    reference = _check(reference_llm, args.check_tokens)
    del reference_llm
    gc.collect()
    for label in args.rows:
        row = run_row(args.model, ROWS[label], args, prompts, reference)
        row["weight_mib"] = _weight_mib(ROWS[label]) if args.model is None else float("nan")
        result["rows"][label] = row
        print(f"{label}: {row['batch1_tokens_per_s']:.1f} tok/s at batch 1, {row['batch_tokens_per_s']:.0f} at "
              f"batch {args.batch_size}, close={row['close']}", flush=True)
    result["load_average"]["after"] = os.getloadavg()
    for row in result["rows"].values():
        row.pop("logprobs")
    write_results("linear_methods", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
