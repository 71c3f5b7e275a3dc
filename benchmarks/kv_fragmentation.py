"""KV waste and concurrency, model-free: stage1's contiguous reservations against stage2's blocks.

The PagedAttention paper's headline on one KV budget (in tokens) and one seeded ShareGPT-like
trace of (prompt, output) lengths. Requests are admitted in trace order until the next one
does not fit; each admitted request is then looked at when it holds its full length
(prompt + output tokens written), the moment its memory need peaks:

- stage1 (``ContiguousKVCache``): every request reserves ``max_model_len`` contiguous slots;
- stage2 (``BlockAllocator`` + ``BlockTable``): a request holds ``ceil(len / block_size)`` blocks.

Waste = reserved-but-unused slots / reserved slots (internal fragmentation); external
fragmentation = free slots that cannot host the next request (stage1: extents shorter than
one reservation; stage2: always 0, any free block will do).

That snapshot has no external fragmentation at all: every reservation is the same size and the
slab is filled from one end, so no hole can form; stage1's engine is the same (static batching
admits a batch only into an empty slab). Holes need reservations of different sizes that end at
different times. The second study is that server: requests leave as soon as they finish
(iteration-level scheduling, as Orca did) and each reserves ``prompt + max_tokens`` contiguous
slots, ``max_tokens`` being what the client asked for (here its output length rounded up to a
power of two). Over the whole trace it records how often the next request waits although
enough slots are free, because no single hole is large enough, against the same timeline on
blocks of 16 (admitted by the blocks they could need, as stage2 does), where that cannot happen.

    python -m benchmarks.kv_fragmentation [--max-model-len 2048 --kv-tokens 32768 --num-requests 512 --seed 0]
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common import benchmark_parser, provenance, run_info, save_figure, write_results
from course.workloads import sharegpt_like_lengths
from stage1_naive import ContiguousKVCache
from stage2_paged import BlockAllocator, BlockTable, OutOfBlocksError

BLOCK_SIZES = (8, 16, 32)


def naive_study(lengths: list[tuple[int, int]], kv_tokens: int, max_model_len: int) -> dict:
    cache = ContiguousKVCache(kv_tokens)
    admitted = 0
    for i, (p, o) in enumerate(lengths):
        if cache.reserve(str(i), max_model_len) is None:
            break
        cache.mark_written(str(i), p + o)
        admitted += 1
    reserved, used = cache.reserved_slots, cache.used_slots
    return {"requests_fit": admitted, "reserved_slots": reserved, "used_slots": used,
            "internal_fragmentation": cache.internal_fragmentation,
            "external_fragmentation": cache.external_fragmentation(max_model_len),
            "free_slots": cache.free_slots, "waste_pct": 100.0 * (reserved - used) / reserved if reserved else 0.0}


def paged_study(lengths: list[tuple[int, int]], kv_tokens: int, block_size: int) -> dict:
    allocator = BlockAllocator(kv_tokens // block_size)
    tables, used = [], 0
    for p, o in lengths:
        table = BlockTable(block_size)
        try:
            table.grow(p + o, allocator)
        except OutOfBlocksError:
            break
        tables.append(table)
        used += p + o
    reserved = sum(t.capacity for t in tables)
    return {"block_size": block_size, "num_blocks": allocator.num_blocks, "requests_fit": len(tables),
            "reserved_slots": reserved, "used_slots": used, "internal_fragmentation": reserved - used,
            "external_fragmentation": 0, "free_slots": allocator.num_free * block_size,
            "waste_pct": 100.0 * (reserved - used) / reserved if reserved else 0.0}


def max_tokens_asked(prompt_len: int, output_len: int, max_model_len: int) -> int:
    """What the client asked for: the output it got, rounded up to a power of two (within max_model_len)."""
    return min(1 << (output_len - 1).bit_length(), max_model_len - prompt_len)


def timeline_study(lengths: list[tuple[int, int]], kv_tokens: int, max_model_len: int,
                   block_size: int | None = None) -> dict:
    """Requests leave when they finish; FCFS admission whenever the head of the queue fits.

    Each request reserves ``prompt + max_tokens`` slots: one contiguous extent (``block_size`` None),
    or that many slots' worth of blocks. One step = one token for every resident request (its
    prompt counts as one step); it is resident for ``output_len`` steps. The head of the queue is
    *blocked by fragmentation* in a step where enough slots are free but no hole fits it.
    """
    need = [p + max_tokens_asked(p, o, max_model_len) for p, o in lengths]
    cache = ContiguousKVCache(kv_tokens) if block_size is None else None
    allocator = BlockAllocator(kv_tokens // block_size) if block_size else None
    waiting, resident, blocks_of = list(range(len(lengths))), {}, {}
    steps = resident_sum = blocked_steps = 0
    external_when_blocked = []
    resident_trace, blocked_trace = [], []
    while waiting or resident:
        while waiting:  # admit FCFS until the head does not fit
            head = waiting[0]
            if cache is not None:
                if cache.reserve(str(head), need[head]) is None:
                    break
            else:
                count = -(-need[head] // block_size)
                if count > allocator.num_free:
                    break
                blocks_of[head] = allocator.allocate(count)
            waiting.pop(0)
            resident[head] = lengths[head][1]  # steps left
        blocked = False
        if waiting and cache is not None and cache.free_slots >= need[waiting[0]]:
            blocked = True
            external_when_blocked.append(cache.external_fragmentation(need[waiting[0]]))
        blocked_steps += blocked
        steps += 1
        resident_sum += len(resident)
        resident_trace.append(len(resident))
        blocked_trace.append(blocked)
        for rid in list(resident):
            resident[rid] -= 1
            if resident[rid] == 0:
                del resident[rid]
                if cache is not None:
                    cache.release(str(rid))
                else:
                    allocator.free(blocks_of.pop(rid))
    return {"layout": "contiguous" if block_size is None else f"blocks of {block_size}", "steps": steps,
            "mean_resident": resident_sum / steps, "blocked_steps": blocked_steps,
            "blocked_pct": 100.0 * blocked_steps / steps,
            "mean_external_when_blocked": (sum(external_when_blocked) / len(external_when_blocked)
                                           if external_when_blocked else 0.0),
            "max_external_when_blocked": max(external_when_blocked, default=0),
            "resident_trace": resident_trace, "blocked_trace": blocked_trace}


def run(max_model_len: int = 2048, kv_tokens: int = 32768, num_requests: int = 512, seed: int = 0,
        block_sizes: tuple[int, ...] = BLOCK_SIZES) -> dict:
    lengths = sharegpt_like_lengths(num_requests, seed, max_total_len=max_model_len)
    naive = naive_study(lengths, kv_tokens, max_model_len)
    paged = [paged_study(lengths, kv_tokens, bs) for bs in block_sizes]
    for row in paged:
        row["concurrency_vs_stage1"] = row["requests_fit"] / naive["requests_fit"] if naive["requests_fit"] else None
    totals = [p + o for p, o in lengths]
    return {
        "config": {"max_model_len": max_model_len, "kv_tokens": kv_tokens, "num_requests": num_requests, "seed": seed,
                   "block_sizes": list(block_sizes)},
        "trace": {"mean_prompt_len": sum(p for p, _ in lengths) / len(lengths),
                  "mean_output_len": sum(o for _, o in lengths) / len(lengths),
                  "mean_total_len": sum(totals) / len(totals), "max_total_len": max(totals),
                  "distribution": "log-normal prompt (median 100, sigma 1) and output (median 200, sigma 1), "
                                  "clipped; prompt + output <= max_model_len"},
        "stage1": naive,
        "stage2": paged,
        "timeline": {"max_tokens": "each request's output length rounded up to a power of two, "
                                   "within max_model_len",
                     "contiguous": timeline_study(lengths, kv_tokens, max_model_len),
                     "paged": timeline_study(lengths, kv_tokens, max_model_len, block_size=16)},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["stage1\nmax_model_len"] + [f"stage2\nblock {r['block_size']}" for r in result["stage2"]]
    rows = [result["stage1"], *result["stage2"]]
    used = [r["used_slots"] for r in rows]
    internal = [r["internal_fragmentation"] for r in rows]
    external = [r["external_fragmentation"] for r in rows]
    free = [r["free_slots"] - r["external_fragmentation"] for r in rows]
    fig = plt.figure(figsize=(9, 7.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 0.9])
    ax1, ax2, ax3 = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    x = range(len(rows))
    ax1.bar(x, used, label="used (token K/V)", color="#2a9d8f")
    ax1.bar(x, internal, bottom=used, label="internal fragmentation", color="#e76f51")
    b2 = [u + i for u, i in zip(used, internal)]
    ax1.bar(x, external, bottom=b2, label="external fragmentation", color="#f4a261")
    ax1.bar(x, free, bottom=[b + e for b, e in zip(b2, external)], label="free", color="#dddddd")
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set_ylabel("KV slots (tokens)")
    ax1.set_title(f"KV budget {result['config']['kv_tokens']} tokens", fontsize=10)
    ax1.legend(fontsize=7, loc="lower right")
    ax2.bar(x, [r["requests_fit"] for r in rows], color="#264653")
    for i, r in enumerate(rows):
        ax2.text(i, r["requests_fit"], f"{r['requests_fit']}\n{r['waste_pct']:.1f}% waste", ha="center",
                 va="bottom", fontsize=8)
    ax2.set_xticks(list(x), labels, fontsize=8)
    ax2.set_ylabel("requests resident at once")
    ax2.set_title(f"reserving max_model_len={result['config']['max_model_len']}", fontsize=10)
    ax2.margins(y=0.25)
    timeline = result["timeline"]
    for key, color in (("contiguous", "#e76f51"), ("paged", "#264653")):
        t = timeline[key]
        ax3.plot(t["resident_trace"], color=color, lw=1, label=f"{t['layout']}: {t['steps']} steps, "
                 f"{t['mean_resident']:.1f} resident on average")
    contiguous = timeline["contiguous"]
    blocked = [i for i, b in enumerate(contiguous["blocked_trace"]) if b]
    if blocked:
        ax3.scatter(blocked, [0.5] * len(blocked), marker="|", s=40, color="#f4a261",
                    label=f"contiguous: next request blocked by a hole too small ({contiguous['blocked_pct']:.0f}% "
                          "of steps)")
    ax3.set_xlabel("step (one token for every resident request)")
    ax3.set_ylabel("requests resident")
    ax3.set_title("requests leave when they finish; each reserves prompt + max_tokens", fontsize=10)
    ax3.legend(fontsize=7, loc="upper right")
    save_figure(fig, path)


def markdown(result: dict) -> str:
    c, t = result["config"], result["trace"]
    lines = [
        "### KV fragmentation: contiguous reservations vs paged blocks",
        "",
        provenance(result) + ". Model-free.",
        "",
        f"KV budget {c['kv_tokens']} tokens, max_model_len {c['max_model_len']}, trace of {c['num_requests']} "
        f"ShareGPT-like requests (seed {c['seed']}; mean prompt {t['mean_prompt_len']:.0f}, mean output "
        f"{t['mean_output_len']:.0f}, mean total {t['mean_total_len']:.0f} tokens). Requests admitted in order "
        "until the next does not fit; each counted at its full length (prompt + output).",
        "",
        "| engine | requests fit | vs stage1 | reserved | used | internal frag | external frag | waste % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    n = result["stage1"]
    lines.append(f"| stage1 (reserve {c['max_model_len']}) | {n['requests_fit']} | 1.00x | {n['reserved_slots']} | "
                 f"{n['used_slots']} | {n['internal_fragmentation']} | {n['external_fragmentation']} | "
                 f"{n['waste_pct']:.1f} |")
    for r in result["stage2"]:
        ratio = r["concurrency_vs_stage1"]
        lines.append(f"| stage2 (block {r['block_size']}) | {r['requests_fit']} | "
                     f"{ratio:.2f}x | {r['reserved_slots']} | {r['used_slots']} | {r['internal_fragmentation']} | "
                     f"{r['external_fragmentation']} | {r['waste_pct']:.1f} |")
    tl = result["timeline"]
    lines += [
        "",
        "Over time, requests leaving as they finish, each reserving prompt + max_tokens "
        f"(max_tokens: {tl['max_tokens']}); the whole trace queued at once:",
        "",
        "| layout | steps to finish the trace | mean resident | steps the next request waited with enough "
        "free slots | free slots in holes too small then (mean / max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in ("contiguous", "paged"):
        t = tl[key]
        lines.append(f"| {t['layout']} | {t['steps']} | {t['mean_resident']:.1f} | {t['blocked_steps']} "
                     f"({t['blocked_pct']:.0f}%) | {t['mean_external_when_blocked']:.0f} / "
                     f"{t['max_external_when_blocked']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "kv_fragmentation", plot=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-tokens", type=int, default=32768)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    result = {**run_info("benchmarks.kv_fragmentation", argv), **run(args.max_model_len, args.kv_tokens,
                                                                     args.num_requests, args.seed)}
    result["runtime_s"] = round(time.perf_counter() - start, 3)
    plot(result, Path(args.plot))
    for study in (result["timeline"]["contiguous"], result["timeline"]["paged"]):  # per-step traces: the plot's
        del study["resident_trace"], study["blocked_trace"]
    write_results("kv_fragmentation", result, markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
