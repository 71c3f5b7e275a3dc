"""LoRA adapters in one batch: time per decode step with 0, 1, 4 and 8 distinct adapters, against the
base model alone.

One batch of ``--batch-size`` requests (the same prompt, greedy, EOS ignored, so every request
decodes ``--output-len`` tokens and the whole batch steps together), on stage 5's offline ``LLM``
on CPU with its defaults. Two engines are loaded in this one process: the base model without LoRA,
and the same model with ``enable_lora=True`` and ``max_loras`` slots enough for the largest count.
The LoRA engine runs the batch with no adapter, then with 1, 4 and 8 distinct adapters (request
``i`` under adapter ``i mod n``), each a random rank-``--rank`` adapter on every projection written
in PEFT's on-disk format (the most work an adapter can add). The runs go round by round
(``--repeats``), each round starting with the next configuration, and each row is the median
round, so a ratio compares runs seconds apart. Time per step is a request's decode time over its
tokens after the first (``RequestTimeline.tpot``), averaged over the batch: every request decodes
in every step, so this is the step's time.

    python -m benchmarks.lora [--batch-size 32 --adapters 0 1 4 8 --output-len 32 --rank 16 --repeats 3]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams

PROMPT = ("Explain, in a few sentences, why a serving engine keeps the keys and values of every "
          "earlier token, and what it does when the memory for them runs out.")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_path: str, directory: Path, rank: int, seed: int) -> Path:
    """A rank-``rank`` adapter on every projection of every layer, in PEFT's file layout."""
    from safetensors.torch import save_file

    from shared.config import ModelConfig
    from stage5_server.lora.adapter import PROJECTIONS as PLACES
    from stage5_server.lora.adapter import projection_shapes

    config = ModelConfig.from_pretrained(model_path)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (in_features, out_features) in projection_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{PLACES[name]}.{name}"
            a = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
        "lora_dropout": 0.0, "bias": "none"}))
    return directory


def measure(llm, prompt: list[int], batch_size: int, output_len: int, loras: list) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    per_request = [loras[i % len(loras)] for i in range(batch_size)] if loras else None
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch_size, params, use_tqdm=False, lora_request=per_request)
    wall = time.perf_counter() - start
    tpots = [o.timeline.tpot for o in outs if o.timeline.tpot is not None]
    return {"wall_s": wall, "step_s": sum(tpots) / len(tpots), "steps": llm.engine.stats().num_steps - before.num_steps,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def run(model: str | None, batch_size: int, counts: list[int], output_len: int, rank: int, repeats: int,
        threads: int, directory: Path) -> list[dict]:
    from stage5_server import LLM, LoRARequest

    # A budget that admits the whole batch's prompts in one step: every later step is decodes only.
    common = dict(model=model, device="cpu", max_model_len=512, max_num_seqs=batch_size, cpu_threads=threads,
                  max_num_batched_tokens=max(2048, 128 * batch_size))
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=max(1, *counts), max_lora_rank=rank)
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(write_random_adapter(lora.model_path, directory / f"a{i}",
                                                                              rank, seed=i)))
                for i in range(max(counts))]
    prompt = base.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    configs = [("base", base, [])] + [(f"{n} adapters", lora, adapters[:n]) for n in counts]
    for _, llm, loras in configs:  # warm up: every adapter loaded once, every path run once
        measure(llm, prompt, min(batch_size, max(1, len(loras))), 2, loras)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for repeat in range(repeats):
        shift = repeat % len(configs)
        for name, llm, loras in configs[shift:] + configs[:shift]:
            runs[name].append(measure(llm, prompt, batch_size, output_len, loras))
    rows = []
    for name, llm, loras in configs:
        median = sorted(runs[name], key=lambda m: m["step_s"])[len(runs[name]) // 2]
        rows.append({"engine": "base model" if llm is base else "enable_lora", "adapters": len(loras),
                     "config": name, "dtype": str(llm.dtype).removeprefix("torch."), **median,
                     "step_s_runs": [m["step_s"] for m in runs[name]]})
    for _, llm, _ in configs:
        llm.shutdown()
    base_step = rows[0]["step_s"]
    for r in rows:
        r["vs_base"] = r["step_s"] / base_step  # > 1: slower per step than the base model alone
    return rows


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    source = provenance(result, f"{cfg['threads']} torch thread(s), {result['rows'][0]['dtype']}, load average "
                                f"{result['load_before']:.2f} before and {result['load_after']:.2f} after; "
                                f"runtime {result['runtime_s']:.0f} s")
    lines = ["### LoRA: time per decode step with adapters in the batch", "", f"{source}.", "",
             f"Model `{cfg['model']}`, a batch of {cfg['batch_size']} requests decoding {cfg['output_len']} "
             f"tokens each; adapters of rank {cfg['rank']} on every projection; request i runs under adapter "
             f"i mod n. Each row is the median of {cfg['repeats']} rounds; `vs base` is its time per step over "
             "the base model's (no LoRA engine at all).", "",
             "| engine | distinct adapters | ms per step | vs base | steps |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['adapters']} | {r['step_s'] * 1e3:.1f} | {r['vs_base']:.2f}x | "
                     f"{r['steps']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "lora")
    ap.add_argument("--model", default=None, help="checkpoint directory or name; default: the default model")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8], help="distinct adapters per batch")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the configurations; each row the median")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        rows = run(args.model, args.batch_size, args.adapters, args.output_len, args.rank, args.repeats,
                   args.threads, Path(directory))
    result = {**run_info("benchmarks.lora", argv), "load_before": load_before, "load_after": os.getloadavg()[0],
              "runtime_s": time.perf_counter() - start,
              "config": {"model": Path(args.model).name if args.model else "default", "threads": args.threads,
                         "batch_size": args.batch_size, "output_len": args.output_len, "rank": args.rank,
                         "adapters": args.adapters, "repeats": args.repeats},
              "rows": rows}
    write_results("lora", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
