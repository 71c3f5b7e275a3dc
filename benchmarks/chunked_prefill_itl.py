"""What a long prompt arriving does to the inter-token latency of requests already decoding.

Eight short requests are decoding when one long prompt arrives (the seed's R0 and R1, at
scale). Without chunked prefill the whole prompt runs in one step and every decode waits
for it; with chunked prefill the token budget feeds the prompt in over several steps and
the decodes keep their pace. Same engine (stage3), same requests, two settings.

    python -m benchmarks.chunked_prefill_itl [--long-prompt-len 1536 --budget 128]
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from course.workloads import random_token_prompts
from shared import SamplingParams, resolve_model, summarize
from stage3_continuous import LLM


def run_setting(model: str, chunked: bool, budget: int, long_len: int, seed: int) -> dict:
    max_model_len = long_len + 64
    llm = LLM(model=model, max_model_len=max_model_len, max_num_seqs=16, block_size=16,
              max_num_batched_tokens=budget if chunked else max_model_len, enable_chunked_prefill=chunked,
              num_kv_blocks=(max_model_len + 8 * 128) // 16 + 16)
    short = random_token_prompts([16] * 8, 500, seed)
    long_prompt = random_token_prompts([long_len], 500, seed + 1)[0]
    decode = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    short_ids = [llm.add_request(p, decode) for p in short]
    for _ in range(8):  # the short requests are decoding
        llm.step()
    long_id = llm.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.step_trace = []
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
    arrival = finished[long_id].timeline.arrival
    # Gaps between the short requests' tokens from the long prompt's arrival on.
    gaps = []
    for rid in short_ids:
        times = [t for t in finished[rid].timeline.token_times]
        gaps += [b - a for a, b in zip(times, times[1:]) if b >= arrival]
    itl = summarize(gaps)
    return {"chunked_prefill": chunked, "max_num_batched_tokens": budget if chunked else max_model_len,
            "steps_for_long_prefill": sum(1 for s in llm.engine.step_trace if s.get(long_id, 0) > 1),
            "itl_ms": {k: v * 1e3 for k, v in itl.items()}, "itl_max_ms": max(gaps) * 1e3,
            "long_ttft_ms": finished[long_id].timeline.ttft * 1e3,
            "outputs": {rid: finished[rid].outputs[0].token_ids for rid in short_ids + [long_id]}}


def markdown(result: dict) -> str:
    c = result["config"]
    rows = result["settings"]
    lines = [
        "### Chunked prefill and inter-token latency",
        "",
        provenance(result, "1 torch thread") + f"; model `{c['model']}`, stage3 engine: 8 requests "
        f"decoding when a {c['long_prompt_len']}-token prompt arrives.",
        "",
        "| chunked prefill | token budget | steps of long prefill | decode ITL p50 ms | p99 ms | max ms | "
        "long prompt TTFT ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {'on' if r['chunked_prefill'] else 'off'} | {r['max_num_batched_tokens']} | "
                     f"{r['steps_for_long_prefill']} | {r['itl_ms']['p50']:.2f} | {r['itl_ms']['p99']:.2f} | "
                     f"{r['itl_max_ms']:.2f} | {r['long_ttft_ms']:.1f} |")
    lines += ["", f"Same tokens with and without chunking: {result['identical_outputs']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "chunked_prefill_itl")
    ap.add_argument("--model", default=None, help="checkpoint dir, or tiny / small (random llamas) / tiny-chat "
                    "(the small trained one) / default (SmolLM2-135M-Instruct); default: tiny")
    ap.add_argument("--long-prompt-len", type=int, default=1536)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = resolve_model(args.model or "tiny")
    settings = [run_setting(model, chunked, args.budget, args.long_prompt_len, args.seed) for chunked in (False, True)]
    identical = settings[0]["outputs"] == settings[1]["outputs"]
    for s in settings:
        del s["outputs"]
    result = {**run_info("benchmarks.chunked_prefill_itl", argv),
              "config": {"model": Path(model).name, "long_prompt_len": args.long_prompt_len},
              "settings": settings, "identical_outputs": identical}
    write_results("chunked_prefill_itl", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
