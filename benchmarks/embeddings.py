"""Embedding throughput: stage5's pooling runner against sentence-transformers' own ``encode``, same
model (all-MiniLM-L6-v2), same sentences, float32 on a CPU, one process, alternating.

Sentences per second at batch 1 (one ``embed`` / ``encode`` call per sentence) and at batch 64 (calls of
64 sentences; stage5 runs them with ``max_num_seqs=64``, sentence-transformers with ``batch_size=64``),
the best of ``--repeats`` rounds each, and the largest difference between the two engines' vectors.

    python -m benchmarks.embeddings [--num-sentences 256 --batch-sizes 1 64 --repeats 3 --threads 2]
"""

from __future__ import annotations

import os
import random
import time

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results

WORDS = ("the engine schedules requests in blocks of tokens while a pooling model returns one vector for each "
         "input sentence and the cache holds keys and values for every layer of the model on the device").split()


def sentences(count: int, seed: int) -> list[str]:
    """Sentences of 4 to 40 words, as a retrieval corpus mixes short queries and passages."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))).capitalize() + "." for _ in range(count)]


def best_rate(run, texts: list[str], batch: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(texts), batch):
            run(texts[i:i + batch])
        best = min(best, time.perf_counter() - start)
    return len(texts) / best


def to_markdown(result: dict) -> str:
    details = f"{result['threads']} torch thread(s), load average {result['load_before']:.2f} before the run"
    lines = ["### Embeddings: stage5's pooling runner against sentence-transformers (all-MiniLM-L6-v2, float32)",
             "", f"{provenance(result, details)}.", "",
             "| batch | stage5 sentences/s | sentence-transformers sentences/s | stage5 / sentence-transformers |",
             "|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['stage5']:.0f} | {r['sentence_transformers']:.0f} | "
                     f"{r['stage5'] / r['sentence_transformers']:.2f}x |")
    lines += ["", f"{result['num_sentences']} sentences of 4 to 40 words; the largest difference between the two "
              f"engines' vectors: {result['max_abs_diff']:.1e}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "embeddings")
    ap.add_argument("--num-sentences", type=int, default=256)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from stage5_server import LLM
    from stage5_server.config.model import resolve_model

    path = resolve_model("all-minilm-l6-v2")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    texts = sentences(args.num_sentences, args.seed)
    llm = LLM(path, dtype="float32", max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192,
              cpu_threads=args.threads)
    torch.set_num_threads(args.threads)
    reference = SentenceTransformer(path, device="cpu")
    rows = []
    for batch in args.batch_sizes:
        def ours(chunk: list[str]) -> None:
            llm.embed(chunk)

        def theirs(chunk: list[str], batch: int = batch) -> None:
            reference.encode(chunk, batch_size=batch, convert_to_numpy=True)

        ours(texts[:batch]), theirs(texts[:batch])  # warm both up
        rates = {"stage5": [], "sentence_transformers": []}
        for _ in range(args.repeats):  # alternating, so a change in load hits both
            rates["stage5"].append(best_rate(ours, texts, batch, 1))
            rates["sentence_transformers"].append(best_rate(theirs, texts, batch, 1))
        rows.append({"batch": batch, **{name: max(values) for name, values in rates.items()}})
    ours_vectors = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
    theirs_vectors = reference.encode(texts, convert_to_tensor=True)
    result = {**run_info("benchmarks.embeddings", argv), "runtime_s": time.perf_counter() - start,
              "load_before": load_before, "threads": args.threads, "num_sentences": args.num_sentences,
              "max_abs_diff": float((ours_vectors - theirs_vectors).abs().max()), "rows": rows}
    write_results("embeddings", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
