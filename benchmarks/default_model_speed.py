"""The default model on this machine: what dequantizing its GGUF file costs, and decode speed at batch 1 and 32.

Sizes: the Q4_1 file on disk, the float32 checkpoint it converts to, the weights in memory at
float32 and bfloat16, and the time a fresh conversion takes. Speed: stage 5's offline engine on
CPU with its defaults (the attention backend ``stagedserve serve`` picks on a CPU), in float32
and in bfloat16, ``B`` requests of the same short prompt decoding together; decode throughput
counts the tokens after each request's first. Every row runs in this one process, so the
ratios are side by side.

    python -m benchmarks.default_model_speed [--batch-sizes 1 32 --output-len 64 --threads 2]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams, resolve_model
from shared.gguf import convert_gguf

PROMPT = [{"role": "user", "content": "Tell me about the history of the bicycle, in a few sentences."}]


def sizes(gguf_file: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        convert_gguf(gguf_file, tmp)
        seconds = time.perf_counter() - start
        converted = (Path(tmp) / "model.safetensors").stat().st_size
    return {"gguf_bytes": gguf_file.stat().st_size, "safetensors_bytes": converted, "convert_s": seconds}


def measure(llm, prompt_ids: list[int], batch_size: int, output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [llm.add_request(prompt_ids, params) for _ in range(batch_size)]
    start = time.perf_counter()
    llm.step()  # every prompt's prefill, and each request's first token
    prefill = time.perf_counter() - start
    done = 0
    while done < batch_size:
        done += sum(out.finished for out in llm.step())
    decode = time.perf_counter() - start - prefill
    assert set(ids).isdisjoint(llm.output_processor.request_states)
    return {"batch_size": batch_size, "prompt_tokens": len(prompt_ids), "prefill_s": prefill, "decode_s": decode,
            "decode_tokens_per_s": batch_size * (output_len - 1) / decode,
            "per_request_tokens_per_s": (output_len - 1) / decode}


def to_markdown(result: dict) -> str:
    s, cfg, rows = result["sizes"], result["config"], result["rows"]
    mib = 1 << 20
    base = rows[0]["decode_tokens_per_s"]
    source = provenance(result, f"{cfg['threads']} torch thread(s), load average {result['load_before']:.2f} "
                                f"before and {result['load_after']:.2f} after")
    lines = [
        "### Default model: size and speed on this machine",
        "",
        "<!-- --8<-- [start:sizes] -->",
        f"{source}.",
        "",
        "| | size | |",
        "|---|---:|---|",
        f"| GGUF file (Q4_1, embeddings Q8_0) | {s['gguf_bytes'] / mib:.1f} MiB | on disk |",
        f"| converted `model.safetensors` (float32) | {s['safetensors_bytes'] / mib:.1f} MiB | "
        f"{s['safetensors_bytes'] / s['gguf_bytes']:.1f}x the file; converting took {s['convert_s']:.1f} s |",
        f"| weights in memory, float32 | {s['params'] * 4 / mib:.1f} MiB | "
        f"{s['params'] / 1e6:.1f}M parameters |",
        f"| weights in memory, bfloat16 (default on CUDA and on CPUs with bf16 units) | "
        f"{s['params'] * 2 / mib:.1f} MiB | |",
        "<!-- --8<-- [end:sizes] -->",
        "",
        "<!-- --8<-- [start:speed] -->",
        f"{source}; stage 5 offline engine on CPU ({cfg['attention_backend']} attention backend), a prompt "
        f"of {rows[0]['prompt_tokens']} tokens, {cfg['output_len']} generated per request.",
        "",
        "| dtype | batch | prefill s | decode tokens/s (all requests) | tokens/s per request | "
        f"vs {rows[0]['dtype']} batch {rows[0]['batch_size']} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['batch_size']} | {r['prefill_s']:.2f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['per_request_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / base:.1f}x |")
    lines.append("<!-- --8<-- [end:speed] -->")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "default_model_speed")
    ap.add_argument("--model", default="default", help="default, or a .gguf file")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from shared.named_models import default_model_file
    from stage5_server import LLM

    load_before = os.getloadavg()[0]
    gguf_file = default_model_file() if args.model == "default" else Path(args.model)
    measured = sizes(gguf_file)
    rows = []
    for dtype in args.dtypes:
        llm = LLM(model=resolve_model(str(gguf_file)), device="cpu", dtype=dtype, max_model_len=256,
                  max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=4096, cpu_threads=args.threads)
        measured["params"] = sum(p.numel() for p in llm.engine.model_executor.driver_worker.model.parameters())
        prompt_ids = llm.tokenizer.apply_chat_template(PROMPT)
        measure(llm, prompt_ids, 1, 4)  # warm-up
        rows += [{"dtype": str(llm.dtype).removeprefix("torch."), **measure(llm, prompt_ids, b, args.output_len)}
                 for b in args.batch_sizes]
        backend = llm.attention_backend_name
    result = {**run_info("benchmarks.default_model_speed", argv), "load_before": load_before,
              "load_after": os.getloadavg()[0], "config": {"model": gguf_file.name, "threads": args.threads,
                                                           "output_len": args.output_len,
                                                           "attention_backend": backend},
              "sizes": measured, "rows": rows}
    write_results("default_model_speed", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
