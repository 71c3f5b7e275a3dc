"""What the inspector records of one engine step, and a recorded run as a file.

One ``StepRecord`` per step that ran: the step's tokens per request by kind against the token budget,
the blocks each request was given, reused or lost that step, the requests preempted and those whose
blocks went back to the pool, the pool's counts, the queues, and what speculative decoding and the
offload tier did. Block ids are physical ids in the rank's pool; a block is *free*, *used* (held by
one request or shared by several), *cached* (free, but its K/V still answer a prefix lookup until it
is reused) or *reserved* (stage 1: inside a request's contiguous reservation, not written yet).

The records hold ids and numbers only, never tokens or text: the engine core never sees text, and a
record crosses to every API server whichever trust group its requests belong to (``hub.py`` decides
what each viewer may see).

A ``Trace`` is a recorded run (``recorders.record``): the records of every step, the settings that
shaped them and each request's text, as the JSON the page replays.

vLLM: no counterpart; the nearest are the iteration stats of ``vllm/v1/metrics/stats.py``
(``IterationStats``), which count what a step did without saying which blocks or which requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

FREE, USED, CACHED, RESERVED = 0, 1, 2, 3  # a block's state on the page


class RequestStep(msgspec.Struct, omit_defaults=True):
    """One request in one step."""

    id: str
    prefill: int = 0  # prompt positions computed (a chunk; or prompt and output again after a preemption)
    decode: int = 0  # 1 for a decode
    verify: int = 0  # draft positions checked by this step's forward pass (speculative decoding)
    accepted: int = 0  # of those, the drafts kept
    sampled: int = 0  # tokens the request gained
    computed: int = 0  # its positions with K/V after the step
    prompt: int = 0  # its prompt length
    # Tuples: most steps give a request no block, and an empty tuple costs nothing per record.
    new: tuple[int, ...] = ()  # blocks it was given this step
    hit: tuple[int, ...] = ()  # blocks it reused from the prefix cache as it was admitted
    loaded: tuple[int, ...] = ()  # of those hits, blocks filled from the offload tier rather than found in the pool
    evicted: tuple[int, ...] = ()  # of its new blocks, cached ones whose K/V were dropped to make room
    reserved: tuple[int, ...] = ()  # stage 1: blocks of its reservation, not written yet
    ttft: float | None = None  # in the step it gained its first token: time since it arrived
    finish: str | None = None  # "stop" | "length" | "abort", in the step it finished
    tpot: float | None = None  # when it finished: time per output token after the first


class FreedBlocks(msgspec.Struct, omit_defaults=True):
    """The blocks a request gave back (it finished, was aborted or preempted)."""

    id: str
    blocks: list[int]
    cached: list[int] = []  # of them, those now free but cached
    why: str = "finished"  # "finished" | "aborted" | "preempted"
    # True: given back as the step was scheduled (preempted, or aborted between steps), so before the blocks
    # the step handed out, which may be these; False: when the step's tokens were taken (it finished)
    scheduling: bool = False


class StepRecord(msgspec.Struct, omit_defaults=True):
    step: int  # the rank's step counter
    time: float  # when the step ended (seconds; a dry run's clock counts steps)
    duration: float  # how long it took
    budget: int | None  # the token budget; None for static batching (stages 1 and 2)
    num_blocks: int  # blocks in the pool (stage 1: block-sized cells of the slab)
    block_size: int
    requests: list[RequestStep] = []  # the scheduled requests, in the order the step packed them
    freed: list[FreedBlocks] = []
    preempted: list[str] = []
    running: list[str] = []  # after the step, in admission order
    waiting: list[str] = []  # after the step, in queue order (the first ``MAX_WAITING_IDS``)
    num_waiting: int = 0
    free: int = 0  # blocks no request holds (cached ones included)
    used: int = 0
    cached: int = 0  # free blocks whose K/V a prefix lookup can still find
    drafts: int = 0  # draft tokens proposed for the next step
    offload_loaded: int = 0  # blocks copied in from the offload tier for this step
    offload_saved: int = 0  # blocks this step copies out to it
    rank: int = 0  # the data-parallel rank (set where the records arrive)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Positions computed per request, as the scheduler's ``num_scheduled_tokens`` counts them."""
        return {r.id: r.prefill + r.decode + r.verify for r in self.requests}

    @property
    def total_tokens(self) -> int:
        return sum(r.prefill + r.decode + r.verify for r in self.requests)


MAX_WAITING_IDS = 256  # a long queue is counted, not listed


class StepRecords(msgspec.Struct):
    """What an engine core hands on with a step's outputs: the records since its last batch, and how many
    its bounded buffer dropped (the oldest) because nobody took them in time."""

    records: list[StepRecord]
    dropped: int = 0


class TraceRequest(msgspec.Struct, omit_defaults=True):
    """A request of a recorded run, with its text (a replay shows it; a live viewer sees only its own)."""

    id: str
    prompt: str | None = None
    output: str | None = None


class Trace(msgspec.Struct, omit_defaults=True):
    """A recorded run: the file the page replays (``save`` / ``load``)."""

    title: str
    engine: str  # the stage that ran it, e.g. "stage4_prefix_cache"
    layout: str = "blocks"  # "slab": stage 1's contiguous reservations, drawn in block-sized cells
    clock: str = "seconds"  # "steps": times count steps (a dry run, or a replay made to be identical each time)
    settings: dict[str, Any] = {}  # the engine arguments that shaped the run
    notes: str = ""
    requests: list[TraceRequest] = []
    steps: list[StepRecord] = []

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(msgspec.json.encode(self) + b"\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)

