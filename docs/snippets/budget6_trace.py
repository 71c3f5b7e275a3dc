"""The budget-6 trace of R0 and R1, driven through the real stage3 Scheduler with token ids only.

R0 (prompt A..H, 8 tokens) is already decoding when R1 (prompt A B C D E F X Y Z, 9 tokens)
arrives. The budget is max_num_batched_tokens=6; no model runs: a request that finishes
its prompt in a step is handed a made-up sampled token, one still mid-prefill an empty list.

Run: .venv/bin/python docs/snippets/budget6_trace.py [--apc]
(--apc: the same trace through stage4's Scheduler with prefix caching on.)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from shared import Request, SamplingParams  # noqa: E402
from stage3_continuous import SchedulerConfig, describe_step, dry_run_step  # noqa: E402

if "--apc" in sys.argv:
    from stage4_prefix_cache import CacheConfig, Scheduler
else:
    from stage3_continuous import CacheConfig, Scheduler

BUDGET = 6


def step(sched: Scheduler, label: str) -> None:
    print(f"{label}: {describe_step(dry_run_step(sched, token=99), BUDGET)}")


sched = Scheduler(SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=4),
                  CacheConfig(block_size=4, num_blocks=16))
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
sched.add_request(Request("R0", [1, 2, 3, 4, 5, 6, 7, 8], params))  # A B C D E F G H
print("warm-up: bring R0 to decoding")
while sched.requests["R0"].num_output_tokens < 2:
    step(sched, "  R0 alone")
sched.add_request(Request("R1", [1, 2, 3, 4, 5, 6, 9, 10, 11], params))  # A B C D E F X Y Z
print("R1 arrives")
for i in range(3):
    step(sched, f"step {i}")
