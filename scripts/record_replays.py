"""Record the course's replays: the traces the Watch page (docs/watch.md) plays in the inspector's viewer.

    python scripts/record_replays.py            # writes docs/assets/replays/*.json
    python scripts/record_replays.py --check    # says which committed trace differs from a fresh recording

Every trace is recorded on the steps clock (times count engine steps), so a recording is the same file
every time; the runs with a model use the tiny random checkpoint (stages 1 and 2) and the default model
(speculative decoding), greedy, in float32 on the CPU.

- ``worked_example`` / ``worked_example_apc``: the budget-6 trace of ``docs/snippets/budget6_trace.py``
  (R0 decoding while R1's nine-token prompt arrives), through stage 3's scheduler and stage 4's with
  prefix caching, driven with token ids alone;
- ``stage1_slab`` / ``stage2_blocks``: six requests through stage 1's contiguous slab and stage 2's blocks,
  on the same KV budget;
- ``preemption``: four requests that each grow to 30 tokens in a pool of twelve 4-token blocks (stage 3);
- ``speculative``: stage 5 with n-gram drafts on a prompt that repeats itself, beside one that does not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared import Request, SamplingParams  # noqa: E402
from stage5_server.inspector import Trace, TraceRequest, dry_run, record  # noqa: E402

OUT = ROOT / "docs" / "assets" / "replays"
LETTERS = {1: "A", 2: "B", 3: "C", 4: "D", 5: "E", 6: "F", 7: "G", 8: "H", 9: "X", 10: "Y", 11: "Z"}
R0_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # A B C D E F G H
R1_PROMPT = [1, 2, 3, 4, 5, 6, 9, 10, 11]  # A B C D E F X Y Z


def worked_example(apc: bool) -> Trace:
    from stage3_continuous import SchedulerConfig

    if apc:
        from stage4_prefix_cache import CacheConfig, Scheduler
    else:
        from stage3_continuous import CacheConfig, Scheduler
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=4),
                          CacheConfig(block_size=4, num_blocks=16))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    steps = dry_run(scheduler, {0: [Request("R0", R0_PROMPT, params)], 3: [Request("R1", R1_PROMPT, params)]},
                    token=99)
    requests = [TraceRequest(rid, " ".join(LETTERS[t] for t in prompt))
                for rid, prompt in (("R0", R0_PROMPT), ("R1", R1_PROMPT))]
    name = "stage 4, prefix caching on" if apc else "stage 3, no prefix cache"
    return Trace(title=f"The budget-6 trace: R0 decodes while R1's nine-token prompt arrives ({name})",
                 engine="stage4_prefix_cache" if apc else "stage3_continuous", clock="steps",
                 settings={"max_num_batched_tokens": 6, "block_size": 4, "num_kv_blocks": 16,
                           "enable_prefix_caching": apc},
                 notes="Three warm-up steps bring R0 to decoding; R1 arrives before step 4. "
                       "Outputs are made-up tokens: the scheduler runs without a model.",
                 requests=requests, steps=steps)


SLAB_WORK = [([5 + i] * n, m) for i, (n, m) in enumerate([(8, 6), (9, 12), (5, 4), (12, 8), (6, 10), (10, 5)])]


def slab_and_blocks(stage: int) -> Trace:
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in SLAB_WORK]
    common = dict(model="tiny", max_model_len=32, max_num_seqs=8, dtype="float32", seed=0)
    if stage == 1:
        from stage1_naive import LLM

        llm = LLM(num_kv_slots=128, **common)
        title = "Stage 1: every request reserves max_model_len = 32 slots of a 128-slot slab"
    else:
        from stage2_paged import LLM

        llm = LLM(block_size=4, num_kv_blocks=32, **common)
        title = "Stage 2: the same requests and the same 128 slots, as 32 blocks of 4"
    trace = record(llm, [p for p, _ in SLAB_WORK], greedy, title=title, clock="steps", cell_size=4,
                   notes="Six requests, prompts of 5 to 12 tokens, 4 to 12 tokens out; static batching.")
    # The random checkpoint's words mean nothing: say what each request is instead.
    trace.requests = [TraceRequest(r.id, f"{len(p)} prompt tokens, {m} out") for r, (p, m) in zip(trace.requests,
                                                                                                   SLAB_WORK)]
    return trace


def preemption() -> Trace:
    from stage3_continuous import CacheConfig, Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                          CacheConfig(block_size=4, num_blocks=12), max_model_len=48)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    work = [Request(f"R{i}", [40 + i] * 6, params) for i in range(4)]
    return Trace(title="Preemption: four requests that each grow to 30 tokens, in twelve blocks of 4 (stage 3)",
                 engine="stage3_continuous", clock="steps",
                 settings={"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 12},
                 notes="When a running request needs a block and none is free, the newest is preempted: its "
                       "blocks go back and it re-prefills its prompt and output later.",
                 requests=[TraceRequest(r.request_id, f"6 tokens ({40 + i})") for i, r in enumerate(work)],
                 steps=dry_run(scheduler, {0: work}))


SPEC_TEXT = ("The paged KV cache splits every request's keys and values into blocks of sixteen tokens, and a "
             "block table maps each request's logical blocks to physical ones.")


def speculative() -> Trace:
    from stage5_server import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(device="cpu", dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=32,
              max_num_batched_tokens=64, speculative_config=spec, seed=0)
    prompts = [f"{SPEC_TEXT}\n\n{SPEC_TEXT}\n\n{SPEC_TEXT[:40]}", "Three colours are"]
    try:
        return record(llm, prompts, SamplingParams(temperature=0, max_tokens=32), clock="steps",
                      title="Speculative decoding: n-gram drafts, verified in the step that decodes",
                      notes="The first prompt repeats itself, so the drafts looked up in it are mostly kept; "
                            "the second gives the lookup little to find.")
    finally:
        llm.shutdown()


TRACES = {
    "worked_example": lambda: worked_example(apc=False),
    "worked_example_apc": lambda: worked_example(apc=True),
    "stage1_slab": lambda: slab_and_blocks(1),
    "stage2_blocks": lambda: slab_and_blocks(2),
    "preemption": preemption,
    "speculative": speculative,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"which traces (default: all of {', '.join(TRACES)})")
    parser.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in TRACES]
    if unknown:
        parser.error(f"names: unknown {', '.join(unknown)}; choose from {', '.join(TRACES)}")
    differ = []
    for name in args.names or TRACES:
        trace = TRACES[name]()
        path = args.out / f"{name}.json"
        if args.check:
            if not path.is_file() or Trace.load(path) != trace:
                differ.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        trace.save(path)
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {len(trace.steps)} steps")
    if differ:
        print("differ from a fresh recording:", ", ".join(differ))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
