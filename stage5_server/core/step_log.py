"""A line per engine step, where ``STAGEDSERVE_STEP_LOG`` names a directory: what the step held and where
its time went, for a profile of a served engine (``benchmarks/served_profile.py``).

Each engine core process (or offline engine) appends JSON lines to ``<dir>/steps-<pid>.jsonl``: when the
step began (``time.perf_counter``, this process's clock), the seconds its schedule, execute and update
took, its tokens, its requests, and of those the decodes (one token, with its drafts where it verifies
any) and the prompt tokens of the rest. The time from one step's end to the next one's start is the core
loop's: outputs sent, inputs received, or nothing to do. Unset, the core keeps no log and pays one
``None`` check a step.

vLLM: ``VLLM_TORCH_PROFILER_DIR`` (a torch profile of each engine process, started and stopped from the
API server) and the per-iteration stats of ``vllm/v1/metrics/stats.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stage5_server.outputs import SchedulerOutput

STEP_LOG_ENV = "STAGEDSERVE_STEP_LOG"


class StepLog:
    def __init__(self, directory: str | Path):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(directory) / f"steps-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    @classmethod
    def from_env(cls) -> StepLog | None:
        directory = os.environ.get(STEP_LOG_ENV)
        return cls(directory) if directory else None

    def record(self, step: SchedulerOutput, started: float, scheduled: float, executed: float, ended: float) -> None:
        counts, drafts = step.num_scheduled_tokens, step.scheduled_spec_decode_tokens
        decodes = {r for r, n in counts.items() if n == 1 + len(drafts.get(r, ()))}  # a verify step is a decode
        self.file.write(json.dumps({
            "start": started, "schedule_s": scheduled - started, "execute_s": executed - scheduled,
            "update_s": ended - executed, "tokens": step.total_num_scheduled_tokens, "requests": len(counts),
            "decodes": len(decodes), "prompt_tokens": sum(n for r, n in counts.items() if r not in decodes)}) + "\n")


def read_step_logs(directory: str | Path) -> dict[int, list[dict]]:
    """Every process's steps in ``directory``, by process id."""
    return {int(path.stem.removeprefix("steps-")): [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(Path(directory).glob("steps-*.jsonl"))}
