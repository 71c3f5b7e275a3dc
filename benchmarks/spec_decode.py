"""Speculative decoding on the default model: time per output token and acceptance, off against n-gram.

Two workloads, each at batch 1 and at batch B: a copy-heavy one (the model is asked to repeat a
given text with one fix, so long spans of its answer are copies of its prompt: prompt lookup
should pay) and free-form chat (little to copy: speculation should cost little). Every engine is
stage 5's offline ``LLM`` on CPU with its defaults, greedy, the same prompts. Four engines:
speculation off, n-gram with its draft-length policy (``spec_decode/policy.py``, the default),
n-gram drafting ``k`` whenever it matches (``ngram-fixed``, the policy taken out), and a draft
model cut from the target (its first ``--draft-layers`` layers with its norm and head,
``stage5_server/spec_decode/draft_checkpoint.py``: self-speculation without any training). All four are
loaded in this one process and each workload and batch runs on them back to back, so a ratio
compares runs seconds apart, not minutes; ``--repeats`` rounds over the four, each round starting
with the next engine, and each row is an engine's median round (a two-CPU machine's time per
token moves by 10-15% from one run to the next, more than some of the differences measured).
Time per output token is a request's decode time over its tokens after the first
(``RequestTimeline.tpot``), averaged over the batch;
the mean acceptance length is the tokens a verifying step gains per request (``1 + accepted /
drafts``). The last column says whether a row's greedy tokens equal the plain engine's. In
float32 they always do (the tests hold it); in bfloat16 a step that verifies drafts multiplies
several positions at once, which rounds differently from one position, so a near-tie between two
tokens can flip and the texts part (held to closeness, as every bfloat16 path is).

    python -m benchmarks.spec_decode [--batch-sizes 1 16 --output-len 96 --k 4 --draft-layers 6 --repeats 3]
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

TEXT = ("The paged KV cache splits every request's keys and values into blocks of sixteen tokens. "
        "A block table maps each request's logical blocks to physical ones, so memory is taken as a "
        "sequence grows instead of reserved for the longest possible answer. When the pool runs out, "
        "the scheduler preempts the newest request, frees its blocks, and later recomputes its prompt "
        "and the tokens it had generated. Prefix caching goes one step further: full blocks are hashed, "
        "and a new request whose prompt begins with the same tokens reuses those blocks.")
COPY_TASKS = [f"Repeat the following text exactly, but replace the word '{word}' with '{new}'.\n\n{TEXT}"
              for word, new in (("blocks", "pages"), ("request", "query"), ("memory", "storage"),
                                ("scheduler", "planner"))]
CHAT_TASKS = ["Tell me about the history of the bicycle, in a few sentences.",
              "Give me three tips for staying focused while studying.",
              "What makes a good cup of coffee?", "Write a short poem about autumn leaves."]
WORKLOADS = {"copy": COPY_TASKS, "chat": CHAT_TASKS}


def speculative_configs(k: int, draft: str | None = None) -> dict[str, dict | None]:
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    configs = {"off": None, "ngram-fixed": ngram, "ngram": ngram}
    if draft is not None:
        configs["draft"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return configs


def write_draft(model: str | None, num_layers: int, directory: str) -> tuple[str, int]:
    """The target's first ``num_layers`` layers (fewer if it has no more) as a draft checkpoint."""
    from shared.named_models import default_model, resolve_model
    from stage5_server.spec_decode.draft_checkpoint import write_layer_prefix_checkpoint

    source = Path(resolve_model(model) if model else default_model())
    total = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    num_layers = max(1, min(num_layers, total - 1))
    return str(write_layer_prefix_checkpoint(source, Path(directory) / "draft", num_layers)), num_layers


def measure(llm, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len)
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.engine.stats()
    drafts = after.spec_decoding.num_drafts - before.spec_decoding.num_drafts
    accepted = after.spec_decoding.num_accepted_tokens - before.spec_decoding.num_accepted_tokens
    draft_tokens = after.spec_decoding.num_draft_tokens - before.spec_decoding.num_draft_tokens
    tpots = [o.timeline.tpot for o in outs if o.timeline.tpot is not None]
    return {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "tpot_s": sum(tpots) / len(tpots), "steps": after.num_steps - before.num_steps,
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def run(model: str | None, batch_sizes: list[int], output_len: int, k: int, threads: int,
        draft: str | None = None, repeats: int = 3) -> list[dict]:
    from stage5_server import LLM

    engines = {}
    for name, spec in speculative_configs(k, draft).items():
        llm = LLM(model=model, device="cpu", max_model_len=1024, max_num_seqs=max(batch_sizes),
                  max_num_batched_tokens=2048, cpu_threads=threads, speculative_config=spec)
        if name == "ngram-fixed":
            llm.engine.drafter.policy = None  # every match drafts k
        llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
        engines[name] = llm
    rows, names = [], list(engines)
    for workload, tasks in WORKLOADS.items():
        for batch in batch_sizes:
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for repeat in range(repeats):  # the engines in turn, each round starting with the next one
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    llm = engines[name]
                    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in tasks]
                    runs[name].append(measure(llm, [prompts[i % len(prompts)] for i in range(batch)], output_len))
            for name in names:
                median = sorted(runs[name], key=lambda m: m["tpot_s"])[len(runs[name]) // 2]
                rows.append({"speculation": name, "workload": workload, "batch_size": batch,
                             "dtype": str(engines[name].dtype).removeprefix("torch."), **median,
                             "tpot_s_runs": [m["tpot_s"] for m in runs[name]]})
    for llm in engines.values():
        llm.shutdown()
    return rows


def compare(rows: list[dict]) -> list[dict]:
    """Each speculative row against the plain row of the same workload and batch: speedup, same tokens."""
    plain = {(r["workload"], r["batch_size"]): r for r in rows if r["speculation"] == "off"}
    for r in rows:
        base = plain[(r["workload"], r["batch_size"])]
        r["tpot_vs_off"] = base["tpot_s"] / r["tpot_s"]  # > 1: faster per output token
        r["same_tokens_as_off"] = r["token_ids"] == base["token_ids"]
    return rows


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    source = provenance(result, f"{cfg['threads']} torch thread(s), {result['rows'][0]['dtype']}, load average "
                                f"{result['load_before']:.2f} before and {result['load_after']:.2f} after; "
                                f"runtime {result['runtime_s']:.0f} s")
    lines = ["### Speculative decoding: time per output token", "", f"{source}.", "",
             f"Model `{cfg['model']}`, greedy, {cfg['output_len']} tokens at most per request, each row the "
             f"median of {cfg.get('repeats', 1)} rounds over the engines; n-gram: "
             f"`{cfg['ngram']}`; `ngram` drafts as many tokens as its policy says pay, `ngram-fixed` "
             f"drafts k whenever the n-gram matches; `draft` is the target's first {cfg['draft_layers']} "
             "layers with its head, drafting greedily under the same policy.", "",
             "| workload | batch | speculation | TPOT ms | vs off | mean acceptance length | acceptance rate "
             "| steps | same tokens as off |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    rank = {"off": 0, "ngram-fixed": 1, "ngram": 2, "draft": 3}
    order = lambda r: (r["workload"] != "copy", r["batch_size"], rank.get(r["speculation"], 3))  # noqa: E731
    for r in sorted(result["rows"], key=order):
        lines.append(f"| {r['workload']} | {r['batch_size']} | {r['speculation']} | {r['tpot_s'] * 1e3:.1f} | "
                     f"{r['tpot_vs_off']:.2f}x | {r['mean_acceptance_length']:.2f} | "
                     f"{100 * r['acceptance_rate']:.0f}% | {r['steps']} | {r['same_tokens_as_off']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "spec_decode")
    ap.add_argument("--model", default=None, help="checkpoint directory, .gguf file or name; default: the default "
                                                  "model")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--draft-layers", type=int, default=6, help="layers of the target kept in the draft model")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the engines; each row is the median round")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        draft, draft_layers = write_draft(args.model, args.draft_layers, directory)
        rows = compare(run(args.model, args.batch_sizes, args.output_len, args.k, args.threads, draft, args.repeats))
    for r in rows:
        r.pop("token_ids")
    result = {**run_info("benchmarks.spec_decode", argv), "load_before": load_before, "load_after": os.getloadavg()[0],
              "runtime_s": time.perf_counter() - start,
              "config": {"model": Path(args.model).name if args.model else "default", "threads": args.threads,
                         "output_len": args.output_len, "batch_sizes": args.batch_sizes, "repeats": args.repeats,
                         "ngram": speculative_configs(args.k)["ngram"], "draft_layers": draft_layers},
              "rows": rows}
    write_results("spec_decode", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
