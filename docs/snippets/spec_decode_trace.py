"""The budget-6 trace with speculative decoding: R0 verifies three n-gram drafts, one is rejected.

Driven through the real stage 5 Scheduler and the real n-gram proposer with token ids only (A=1,
B=2, ...). No model runs: the tokens the model "would say" are scripted (TRUTH), and a step keeps
R0's drafts while they equal those tokens, then takes the model's own token: the greedy form of
the rejection rule (stage5_server/spec_decode/rejection_sampler.py).

Run: .venv/bin/python docs/snippets/spec_decode_trace.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from shared import SamplingParams  # noqa: E402
from stage4_prefix_cache import CacheConfig, SchedulerConfig  # noqa: E402
from stage5_server.core import Scheduler  # noqa: E402
from stage5_server.core.request import Request  # noqa: E402
from stage5_server.spec_decode import NgramProposer  # noqa: E402

BUDGET = 6
TRUTH = {"R0": [3, 4, 5, 26, 25, 24, 23], "R1": [20, 21, 22, 19]}  # the model's tokens: C D E Z Y X W; T U V S


def letters(tokens: list[int]) -> str:
    return " ".join(chr(ord("A") + t - 1) for t in tokens)


def step(sched: Scheduler, proposer: NgramProposer, label: str) -> None:
    output = sched.schedule()
    sampled, parts = {}, []
    for rid, num_new in output.num_scheduled_tokens.items():  # the running requests, then the new ones
        request = sched.requests[rid]
        drafts = output.scheduled_spec_decode_tokens.get(rid, [])
        truth = TRUTH[rid][request.num_output_tokens:]
        if request.num_computed_tokens + num_new < request.num_tokens + len(drafts):
            sampled[rid] = []  # mid-prefill: nothing to sample
            parts.append(f"{rid} prefill {num_new}")
            continue
        kept = []
        for draft, said in zip(drafts, truth):
            kept.append(said)
            if said != draft:
                break
        else:
            kept.append(truth[len(drafts)])
        sampled[rid] = kept
        kind = "prefill" if request.num_computed_tokens < request.num_prompt_tokens else "decode"
        if drafts:
            rejected = len(drafts) + 1 - len(kept)
            parts.append(f"{rid} decode 1+{len(drafts)} [{letters(drafts)}] -> [{letters(kept)}] "
                         f"({rejected} back)")
        else:
            parts.append(f"{rid} {kind} {num_new} -> [{letters(kept)}]")
    sched.update_from_output(output, sampled)
    print(f"{label}: {', '.join(parts)}; used {output.total_num_scheduled_tokens}/{BUDGET}")
    for request in list(sched.running):
        if sampled.get(request.request_id):
            drafts = proposer.propose(request.all_token_ids)
            sched.add_draft_tokens(request, drafts)
            if drafts:
                print(f"  proposer: {request.request_id} ends [... {letters(request.all_token_ids[-3:])}]"
                      f" -> drafts [{letters(drafts)}]")
    r0 = sched.requests["R0"]
    print(f"  R0: {r0.num_tokens} tokens, {r0.num_computed_tokens} with KV, "
          f"{len(sched.kv_cache_manager.get_block_ids('R0'))} blocks")


sched = Scheduler(SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=4),
                  CacheConfig(block_size=4, num_blocks=16, enable_prefix_caching=False), max_model_len=64)
proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
sched.add_request(Request("R0", [1, 2, 3, 4, 5, 6, 1, 2], params))  # A B C D E F A B
print("warm-up: bring R0 to decoding")
step(sched, proposer, "  R0 alone")
step(sched, proposer, "  R0 alone")
sched.add_request(Request("R1", [1, 2, 3, 4, 5, 6, 9, 10, 11], params))  # A B C D E F I J K
print("R1 arrives")
for i in range(3):
    step(sched, proposer, f"step {i}")
