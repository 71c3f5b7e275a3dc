"""Write the course notebooks with nbformat, then execute them with nbclient so outputs are stored.

Run from the repository root:

    .venv/bin/python docs/notebooks/build_notebooks.py            # write and execute all
    .venv/bin/python docs/notebooks/build_notebooks.py --no-exec  # write only

Every notebook uses the embedded default model (``shared.default_model()``, a small Llama
trained to answer simple checkable questions, committed in the repository), so nothing is
built or downloaded. Most cells feed token ids and pin output lengths, because what they show
is how each stage stores and schedules tokens; the last notebook also asks real questions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SETUP = """\
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message="IProgress not found")
torch.set_num_threads(1)  # a tiny model: one thread is many times faster than several contending

# Run from the repository root (the tests and build script do); find it either way.
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").is_file())
sys.path.insert(0, str(ROOT))

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
%matplotlib inline

from shared import SamplingParams, default_model

MODEL = default_model()  # the embedded default model, committed with the code
print("model:", Path(MODEL).name)"""


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


# ---------------------------------------------------------------------------------------------
def stage1_slab():
    return [
        md("""
# Stage 1: one contiguous slab, static batching

Every request reserves `max_model_len` slots up front, and a batch runs until its slowest
member ends. Here we run the real stage1 `LLM` on a tiny model, step by step, and record the
slab's accounting after every step: slots *reserved* by live requests, slots *used* (holding
a token's K/V), and the difference, *internal fragmentation*.
"""),
        code(SETUP),
        code("""
from stage1_naive import LLM

MAX_LEN = 64
llm = LLM(model=MODEL, max_model_len=MAX_LEN, num_kv_slots=4 * MAX_LEN, max_num_seqs=4, seed=0)
slab = llm.engine.kv_cache

# Six requests, prompt 8 tokens, wildly different answer lengths; ignore_eos pins the lengths.
lengths = [4, 40, 8, 12, 24, 6]
for i, n in enumerate(lengths):
    llm.add_request([10 + i] * 8, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=f"R{i}")

rows = []
while llm.has_unfinished_requests():
    llm.step()
    rows.append(dict(reserved=slab.reserved_slots, used=slab.used_slots,
                     internal=slab.internal_fragmentation, free=slab.free_slots,
                     external=slab.external_fragmentation(MAX_LEN)))
print(f"{len(rows)} steps; slab of {slab.num_slots} slots = {slab.num_slots // MAX_LEN} reservations of {MAX_LEN}")
for step in (0, 3, 10, 30, len(rows) - 1):
    print(f"step {step:3d}:", rows[step])
"""),
        md("""
The batch of four admits R0-R3; R0 finishes after 4 tokens but its reservation stays held
until R1 (40 tokens) is done. Only then can R4 and R5 start. The plot shows used slots
against reserved ones: the gap is memory that no one can use.
"""),
        code("""
steps = range(len(rows))
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.fill_between(steps, [r["reserved"] for r in rows], step="mid", alpha=0.3, label="reserved")
ax.fill_between(steps, [r["used"] for r in rows], step="mid", alpha=0.8, label="used (holds K/V)")
ax.axhline(slab.num_slots, color="k", lw=0.8, ls="--", label="slab size")
ax.set_xlabel("engine step"); ax.set_ylabel("slots"); ax.legend(loc="upper right")
ax.set_title("stage1 slab occupancy per step")
plt.show()
frag = [r["internal"] / r["reserved"] for r in rows if r["reserved"]]
print(f"mean internal fragmentation over the run: {sum(frag) / len(frag):.1%} of reserved slots")
"""),
        md("""
## External fragmentation, without a model

`ContiguousKVCache` works without tensors too. Reserve extents of different sizes, release
two that are not adjacent, and a reservation that fits in the total free space still fails:
the free space is split into holes.
"""),
        code("""
from stage1_naive import ContiguousKVCache

cache = ContiguousKVCache(num_slots=100)
for rid, size in [("a", 20), ("b", 30), ("c", 20), ("d", 30)]:
    cache.reserve(rid, size)
cache.release("a"); cache.release("c")
print("free slots:", cache.free_slots, "largest hole:", cache.largest_free_extent())
print("reserve 30 ->", cache.reserve("e", 30), "(None: no hole is large enough)")
print("external fragmentation for a 30-slot request:", cache.external_fragmentation(30))
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage2_block_tables():
    return [
        md("""
# Stage 2: KV blocks and block tables

Same static-batching loop as stage1; the KV cache is now a pool of fixed-size blocks, and
each request's block table maps its logical blocks to any free physical blocks. Blocks are
taken as a sequence grows and returned the moment it ends. Below: a map of the pool after
selected steps, one colour per request.
"""),
        code(SETUP),
        code("""
import numpy as np
from stage2_paged import LLM

BLOCK, NUM_BLOCKS = 4, 32
llm = LLM(model=MODEL, max_model_len=64, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_num_seqs=4,
          block_shuffle_seed=1, seed=0)  # shuffled free list: physical order must not matter
lengths = [4, 20, 8, 12]
for i, n in enumerate(lengths):
    llm.add_request([20 + i] * 6, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=f"R{i}")

snapshots = []
while llm.has_unfinished_requests():
    llm.step()
    snapshots.append(llm.engine.live_block_ids())
for step in (0, 2, 5, 10):
    print(f"step {step:2d}:", snapshots[step])
"""),
        code("""
def pool_map(tables, num_blocks=NUM_BLOCKS):
    grid = np.full(num_blocks, -1)
    for rid, ids in tables.items():
        grid[ids] = int(rid[1:])
    return grid.reshape(4, num_blocks // 4)

shown = [0, 2, 5, 8, 12, len(snapshots) - 1]
cmap = plt.get_cmap("tab10").copy(); cmap.set_under("white")
fig, axes = plt.subplots(1, len(shown), figsize=(2.2 * len(shown), 2.4))
for ax, step in zip(axes, shown):
    grid = pool_map(snapshots[step])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=9)
    for (y, x), v in np.ndenumerate(grid):
        ax.text(x, y, "" if v < 0 else f"R{v}", ha="center", va="center", fontsize=7)
    ax.set_title(f"after step {step}", fontsize=9); ax.set_xticks([]); ax.set_yticks([])
fig.suptitle(f"KV pool: {NUM_BLOCKS} blocks of {BLOCK} tokens (white = free)")
plt.tight_layout(); plt.show()
"""),
        md("""
A block table is only a list of physical ids; the slot of position `p` is
`table[p // block_size] * block_size + p % block_size`. The `BlockTable` class computes it:
"""),
        code("""
from stage2_paged import BlockAllocator, BlockTable

alloc = BlockAllocator(8)
table = BlockTable(block_size=4)
table.grow(6, alloc)        # 6 tokens -> 2 blocks
print("blocks:", table.block_ids, "slots of positions 0..5:", table.slot_mapping(0, 6))
table.grow(9, alloc)        # grows into a third block only when needed
print("blocks:", table.block_ids, "free left:", alloc.num_free)
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage3_scheduler():
    return [
        md("""
# Stage 3: one token budget per step

The scheduler spends `max_num_batched_tokens` per step: running requests first (a decode
costs one token), then chunks of waiting prompts. First the budget-6 trace of R0 and R1,
through the real `Scheduler` with token ids only (no model).
"""),
        code(SETUP),
        code("""
from shared import Request
from stage3_continuous import CacheConfig, Scheduler, SchedulerConfig, describe_step, dry_run_step

BUDGET = 6
sched = Scheduler(SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=4), CacheConfig(block_size=4, num_blocks=16))
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

def step(label):  # a made-up token (99) for each request that finishes its prompt; mid-prefill: none
    print(f"{label}: {describe_step(dry_run_step(sched, token=99), BUDGET)}")

sched.add_request(Request("R0", [1, 2, 3, 4, 5, 6, 7, 8], params))       # A..H
while sched.requests["R0"].num_output_tokens < 2:
    step("  R0 alone")
sched.add_request(Request("R1", [1, 2, 3, 4, 5, 6, 9, 10, 11], params))  # A B C D E F X Y Z
for i in range(3):
    step(f"step {i}")
"""),
        md("""
R0 gets its decode token first in every step; R1's nine prompt tokens go in as 5 + 4; in
step 2 both decode. Now the same engine with a model: a per-step timeline of tokens per
request, prefill (hatched) against decode.
"""),
        code("""
from stage3_continuous import LLM

def run_traced(llm, prompts_and_lengths):
    for i, (prompt, n) in enumerate(prompts_and_lengths):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=f"R{i}")
    eng = llm.engine
    eng.step_trace = []
    kinds, usage, preempt = [], [], []
    while llm.has_unfinished_requests():
        before = {rid: (r.num_computed_tokens, r.num_tokens) for rid, r in eng.scheduler.requests.items()}
        llm.step()
        counts = eng.step_trace[-1]
        kinds.append({rid: (n, "decode" if before[rid][1] - before[rid][0] == 1 else "prefill")
                      for rid, n in counts.items()})
        usage.append(eng.kv_cache_usage()); preempt.append(eng.stats().num_preemptions)
    return kinds, usage, preempt

def plot_timeline(kinds, title, budget):
    fig, ax = plt.subplots(figsize=(9, 3))
    ids = sorted({rid for k in kinds for rid in k}, key=lambda r: int(r[1:]))
    colors = {rid: plt.get_cmap("tab10")(i) for i, rid in enumerate(ids)}
    for s, k in enumerate(kinds):
        bottom = 0
        for rid in ids:
            if rid in k:
                n, kind = k[rid]
                ax.bar(s, n, bottom=bottom, color=colors[rid], hatch="///" if kind == "prefill" else None,
                       edgecolor="k", linewidth=0.3, label=rid if s == min(i for i, kk in enumerate(kinds) if rid in kk) else None)
                bottom += n
    ax.axhline(budget, color="k", ls="--", lw=0.8)
    ax.set_xlabel("step"); ax.set_ylabel("tokens scheduled"); ax.set_title(title)
    ax.legend(ncol=len(ids), fontsize=7, loc="upper right")
    plt.show()

llm = LLM(model=MODEL, max_model_len=128, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=8)
kinds, usage, preempt = run_traced(llm, [([30] * 5, 12), ([31] * 40, 6), ([32] * 9, 10), ([33] * 20, 4)])
plot_timeline(kinds, "stage3: budget 16, hatched = prefill chunk", 16)
print("steps:", len(kinds), "preemptions:", preempt[-1])
"""),
        md("""
## Preemption in a small pool

Twelve blocks of four tokens cannot hold four requests that each grow to 30 tokens. When a
running request needs a block and none is free, the newest request is preempted: its blocks
are freed and it later re-prefills its prompt plus the tokens it had already generated.
"""),
        code("""
work = [([40 + i] * 6, 24) for i in range(4)]
small = LLM(model=MODEL, max_model_len=48, block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=8)
kinds, usage, preempt = run_traced(small, work)
plot_timeline(kinds, "stage3, 12-block pool: preempted requests re-prefill (hatched) later", 16)
fig, ax = plt.subplots(figsize=(9, 2.4))
ax.plot(usage, label="KV usage"); ax2 = ax.twinx(); ax2.step(range(len(preempt)), preempt, color="C3", label="preemptions")
ax.set_xlabel("step"); ax.set_ylabel("KV usage"); ax2.set_ylabel("preemptions (cumulative)")
fig.legend(loc="lower right", fontsize=8); plt.show()
print("preemptions:", preempt[-1], "steps:", len(kinds))

big = LLM(model=MODEL, max_model_len=48, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=8)
p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
same = [o.outputs[0].token_ids for o in small.generate([w for w, _ in work], p, use_tqdm=False)] == \\
       [o.outputs[0].token_ids for o in big.generate([w for w, _ in work], p, use_tqdm=False)]
print("tokens identical to a run with a large pool:", same)
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage4_prefix_cache():
    return [
        md("""
# Stage 4: automatic prefix caching

A full block is named by a chained hash: H(parent hash, its tokens, extra keys). Equal tokens
after different prefixes, or under different cache salts, get different names.
"""),
        code(SETUP),
        code("""
from stage4_prefix_cache import hash_request_tokens

A_H = [1, 2, 3, 4, 5, 6, 7, 8]            # R0: A B C D E F G H
R1 = [1, 2, 3, 4, 5, 6, 9, 10, 11]         # R1: A B C D E F X Y Z
short = lambda hs: [h.hex()[:8] for h in hs]
print("R0         ", short(hash_request_tokens(4, A_H)))
print("R1         ", short(hash_request_tokens(4, R1)), "(partial Z block: no hash)")
print("R0 salt=t1 ", short(hash_request_tokens(4, A_H, (("salt", "t1"),))))
print("E F G H as first block:", short(hash_request_tokens(4, [5, 6, 7, 8])), "(no parent: a different hash)")
"""),
        md("""
## Hits are rounded down to whole blocks

The real `KVCacheManager` (block size 4): an earlier request leaves its blocks cached, then
the lookup for a new prompt says how many tokens it may skip. The last prompt position is
always computed (its logits give the first output token), so a fully cached 8-token prompt
still recomputes its last block.
"""),
        code("""
from shared import Request
from stage4_prefix_cache import KVCacheManager

P = SamplingParams(max_tokens=4)

def reusable(shared, prompt_len):
    kv = KVCacheManager(block_size=4, num_blocks=16)
    common = list(range(1, shared + 1))
    r0 = Request("R0", common + [500 + i for i in range(12 - shared)], P)
    kv.allocate_slots(r0, r0.num_tokens); kv.free(r0)          # cached, now free
    r1 = Request("R1", common + [300 + i for i in range(prompt_len - shared)], P)
    return kv.get_computed_blocks(r1)[1]

print("shared  prompt  skipped  computed")
for shared, length in [(6, 9), (7, 9), (8, 9), (8, 8), (1, 1)]:
    hit = reusable(shared, length)
    print(f"{shared:6d}  {length:6d}  {hit:7d}  {length - hit:8d}")
"""),
        md("""
## Free-queue order after releases

A pool of four blocks. R0 (A..H) holds two; R1 shares R0's first block and adds two. Then:
allocation fails, R0 is released, R2 takes the freed block (evicting its hash), R1 is
released. Freed blocks enter the queue in reverse table order; cached ones go to the tail,
uncached ones to the head; allocation pops the head.
"""),
        code("""
kv = KVCacheManager(block_size=4, num_blocks=4)
queue = lambda: [b.block_id for b in kv.block_pool.free_block_queue]
r0 = Request("R0", A_H, P); kv.allocate_slots(r0, 8)
r1 = Request("R1", R1, P); hits, n = kv.get_computed_blocks(r1); kv.allocate_slots(r1, r1.num_tokens - n, n, hits)
print("tables:", kv.get_block_ids("R0"), kv.get_block_ids("R1"), "ref counts:", [b.ref_cnt for b in kv.block_pool.blocks])
r2 = Request("R2", [7, 7, 7, 7], P)
print("R2 allocate ->", kv.allocate_slots(r2, 4))
kv.free(r0); print("after releasing R0, free queue:", queue())
kv.allocate_slots(r2, 4); print("R2 table:", kv.get_block_ids("R2"))
kv.free(r1); print("after releasing R1, free queue (head first):", queue())
"""),
        md("""
## A hit map

Six requests share a 24-token system prefix and differ after it; each prompt is 32 tokens,
block size 4. The first request computes everything; later ones reuse the prefix blocks.
"""),
        code("""
import numpy as np
from stage4_prefix_cache import LLM

BLOCK = 4
llm = LLM(model=MODEL, max_model_len=128, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=64)
system = [60 + (i % 7) for i in range(24)]
prompts = [system + [100 + 10 * r + j for j in range(8)] for r in range(6)]
outs = []
for p in prompts:  # one at a time, so each request can see the blocks of the ones before
    outs += llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
hits = [o.num_cached_tokens for o in outs]
print("cached prompt tokens per request:", hits)
grid = np.array([[1 if (b + 1) * BLOCK <= h else 0 for b in range(32 // BLOCK)] for h in hits])
fig, ax = plt.subplots(figsize=(5, 2.6))
ax.imshow(grid, cmap="Greens", vmin=0, vmax=1.4)
ax.set_xlabel("prompt block"); ax.set_ylabel("request"); ax.set_title("prefix-cache hits (green = reused block)")
plt.show()
stats = llm.engine.stats()
print(f"prefix cache: {stats.prefix_cache_hits} of {stats.prefix_cache_queries} queried tokens hit")
"""),
    ]


# ---------------------------------------------------------------------------------------------
def all_stages():
    return [
        md("""
# The same prompts through stages 1-4

Greedy decoding is deterministic, so every stage must produce the same tokens; what changes
is how many steps it takes and how much KV it holds. Same KV budget everywhere: 256 token
slots (stage1: one slab; stages 2-4: 64 blocks of 4).
"""),
        code(SETUP),
        md("""
First, real questions. The embedded default model was trained on a few checkable tasks
(sums, squares, counting and reversing words, repeating after a long system prompt), so
each stage should give the right answers, and all four the same ones.
"""),
        code("""
import importlib

questions = ["Add 4 and 5.", "Add 38 and 47.", "What is 7 squared?", "Count the words: cat dog sun owl",
             "Reverse: red fox ship"]
chats = [[{"role": "user", "content": q}] for q in questions]
answers = {}
for name in ["stage1_naive", "stage2_paged", "stage3_continuous", "stage4_prefix_cache"]:
    llm = importlib.import_module(name).LLM(model=MODEL, max_model_len=64, max_num_seqs=8, seed=0)
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    answers[name] = [o.outputs[0].text for o in outs]
for q, a in zip(questions, answers["stage1_naive"]):
    print(f"{q:36s} -> {a}")
print("all stages agree:", all(a == answers["stage1_naive"] for a in answers.values()))
"""),
        md("""
Now the same token-id prompts through each stage, step by step, recording KV usage.
"""),
        code("""
import time

prefix = [70 + (i % 5) for i in range(16)]
prompts = [prefix + [200 + 7 * i + j for j in range(4 + 3 * i)] for i in range(6)]
lengths = [6, 30, 10, 20, 8, 14]
common = dict(model=MODEL, max_model_len=64, max_num_seqs=8, seed=0)
per_stage = {
    "stage1_naive": dict(num_kv_slots=256),
    "stage2_paged": dict(block_size=4, num_kv_blocks=64),
    "stage3_continuous": dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32),
    "stage4_prefix_cache": dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32),
}
results = {}
for name, kwargs in per_stage.items():
    llm = importlib.import_module(name).LLM(**common, **kwargs)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=f"R{i}")
    tokens, usage, steps, t0 = {}, [], 0, time.perf_counter()
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        usage.append(llm.engine.kv_cache_usage()); steps += 1
    stats = llm.engine.stats()
    results[name] = dict(tokens=[tokens[f"R{i}"] for i in range(len(prompts))], usage=usage, steps=steps,
                         prompt_tokens=stats.num_prompt_tokens_computed, seconds=time.perf_counter() - t0)

ref = results["stage1_naive"]["tokens"]
print(f"{'stage':22s} {'identical':>9s} {'steps':>6s} {'peak KV':>8s} {'mean KV':>8s} {'prefill tokens':>15s}")
for name, r in results.items():
    u = r["usage"]
    print(f"{name:22s} {str(r['tokens'] == ref):>9s} {r['steps']:6d} {max(u):8.0%} {sum(u) / len(u):8.0%} "
          f"{r['prompt_tokens']:15d}")
"""),
        code("""
fig, ax = plt.subplots(figsize=(9, 3))
for name, r in results.items():
    ax.plot(r["usage"], label=name)
ax.set_xlabel("engine step"); ax.set_ylabel("KV in use (fraction)"); ax.set_ylim(0, 1.05)
ax.set_title("KV usage per step, same prompts, same KV budget"); ax.legend(fontsize=8)
plt.show()
"""),
        md("""
Stage1 reserves a whole `max_model_len` per request, so it holds most of the slab from the
first step while using little of it. Stage2 holds only the blocks written, but still waits for
the slowest member of each batch. Stage3 lets requests join and leave every step. Stage4 also
skips the shared prefix's prefill once its blocks are cached (fewer prefill tokens).
"""),
    ]


NOTEBOOKS = {
    "stage1_slab.ipynb": stage1_slab,
    "stage2_block_tables.ipynb": stage2_block_tables,
    "stage3_scheduler.ipynb": stage3_scheduler,
    "stage4_prefix_cache.ipynb": stage4_prefix_cache,
    "all_stages.ipynb": all_stages,
}


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 120) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-exec", action="store_true", help="write the notebooks without running them")
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    args = parser.parse_args()
    for name in args.names or NOTEBOOKS:
        nb = build(name)
        if not args.no_exec:
            start = time.perf_counter()
            execute(nb)
            print(f"{name}: executed in {time.perf_counter() - start:.1f} s")
        nbformat.write(nb, HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
