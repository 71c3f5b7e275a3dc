"""Recording a run of any stage, from outside, into a ``Trace`` the page replays.

    from stage5_server.inspector import record
    trace = record(llm, ["prompt one", "prompt two"], SamplingParams(temperature=0, max_tokens=16))
    trace.save("my_run.json")          # then load it on the course's Watch page, or on a server's /inspect

``record`` drives ``llm``'s own ``add_request`` and ``step`` and reads the engine's public state after each
step, so it records every stage without a word added to stages 1-4:

- stage 5: the engine core's own observer (``observer.py``), attached for the run if the engine was built
  without ``enable_inspector``;
- stages 3 and 4: the same observer from outside: for the run, the scheduler's ``schedule`` is wrapped (on
  that one object) to hand each ``SchedulerOutput`` to the observer, which reads the requests, the queues
  and the KV cache manager's tables as the stage 5 core's observer does (``observer.block_tables``);
- stages 1 and 2 (``StaticBatchRecorder``): the static batch, and stage 1's slab reservations cut into
  block-sized cells, or stage 2's block tables.

``dry_run`` records a stage 3 or 4 ``Scheduler`` driven with token ids alone (``stage3_continuous.dry_run``),
as the course's traces are. ``python -m stage5_server.inspector record ...`` is the command-line form.

vLLM: no counterpart; its nearest is the profiler trace of ``vllm/profiler/``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from shared.request import Request
from shared.sampling_params import SamplingParams
from stage5_server.inspector.observer import StepObserver
from stage5_server.inspector.records import (
    MAX_WAITING_IDS,
    FreedBlocks,
    RequestStep,
    StepRecord,
    Trace,
    TraceRequest,
)
from stage5_server.inspector.tracker import BlockTracker, token_kinds

Run = Callable[[], None]  # one step of the engine being recorded

STATIC_BATCH_ENGINES = ("stage1_naive", "stage2_paged")
SETTINGS = ("block_size", "num_kv_blocks", "num_kv_slots", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
            "enable_prefix_caching", "enable_chunked_prefill", "speculative_config")


def record(llm: Any, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None = None, *,
           title: str = "", arrivals: Sequence[int] | None = None, request_ids: Sequence[str] | None = None,
           clock: str = "seconds", notes: str = "", cell_size: int | None = None) -> Trace:
    """Run ``prompts`` through ``llm`` (an ``LLM`` of any stage) and record every step. ``arrivals``: the step
    before which each prompt arrives (default: all at once); ``request_ids``: their ids (default R0, R1, ...);
    ``clock="steps"``: record times in steps, so the same run gives the same file every time; ``cell_size``:
    stage 1's slab drawn in cells of this many slots (default 16)."""
    count = len(prompts)
    params = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * count
    arrivals = list(arrivals) if arrivals is not None else [0] * count
    request_ids = list(request_ids) if request_ids is not None else [f"R{i}" for i in range(count)]
    if not len(params) == len(arrivals) == len(request_ids) == count:
        raise ValueError(f"prompts: {count} prompts need as many params, arrivals and request_ids")
    stage = getattr(llm, "stage", None)
    engine = llm.engine
    kept = {name: getattr(engine, name) for name in ("inspector",) if hasattr(engine, name)}
    steps = _stepper(llm, stage, clock, cell_size)
    texts = {rid: TraceRequest(rid, prompt if isinstance(prompt, str) else None)
             for rid, prompt in zip(request_ids, prompts)}
    records: list[StepRecord] = []
    pending = sorted(zip(arrivals, range(count)))
    try:
        for step in itertools.count():
            while pending and pending[0][0] <= step:
                _, i = pending.pop(0)
                llm.add_request(prompts[i], params[i], request_id=request_ids[i])
            if not llm.has_unfinished_requests():
                if not pending:
                    break
                continue  # nothing to run until the next arrival: an idle step
            records += steps(lambda: _collect(llm.step(), texts))
    finally:
        for name, value in kept.items():  # the engine as it was: no observer or trace left behind
            setattr(engine, name, value)
    return Trace(title=title, engine=stage or type(llm).__module__.split(".")[0],
                 layout="slab" if stage == "stage1_naive" else "blocks", clock=clock,
                 settings={k: v for k, v in getattr(llm, "args", {}).items() if k in SETTINGS and v is not None},
                 notes=notes, requests=list(texts.values()), steps=records)


def _collect(outputs: list[Any], texts: dict[str, TraceRequest]) -> None:
    for output in outputs:
        if output.finished and output.request_id in texts:
            texts[output.request_id].output = output.outputs[0].text


def _stepper(llm: Any, stage: str | None, clock: str, cell_size: int | None) -> Callable[[Run], list[StepRecord]]:
    """A function that runs one step (``run()``) and returns its records, for ``llm``'s stage."""
    engine = llm.engine
    if stage in STATIC_BATCH_ENGINES:
        return StaticBatchRecorder(engine, cell_size, clock=clock).step
    if hasattr(engine, "inspector"):  # stage 5: the core's own observer
        observer = engine.inspector
        if observer is None:
            observer = engine.inspector = StepObserver.for_scheduler(engine.scheduler, clock=clock, capacity=1 << 20)
        else:
            observer.drain()  # records from before this run

        def core_step(run: Run) -> list[StepRecord]:
            run()
            drained = observer.drain()
            return [] if drained is None else drained.records
        return core_step
    observer = StepObserver.for_scheduler(engine.scheduler, clock=clock)

    def scheduler_step(run: Run) -> list[StepRecord]:
        with watching(engine.scheduler, observer) as outputs:
            run()
        for output in outputs:
            observer.stepped(output, None, engine.scheduler)
        return observer.drain().records if len(observer.buffer) else []
    return scheduler_step


@contextmanager
def watching(scheduler: Any, observer: StepObserver) -> Iterator[list[Any]]:
    """Within the block, ``observer.scheduled`` follows each ``scheduler.schedule()`` (a stage 3 or 4
    scheduler's, from outside: its engine calls it), and the outputs are collected. The method is wrapped on
    this one scheduler object, and unwrapped afterwards."""
    outputs: list[Any] = []
    schedule = scheduler.schedule

    def schedule_and_observe() -> Any:
        output = schedule()
        observer.scheduled(output, scheduler)
        outputs.append(output)
        return output

    scheduler.schedule = schedule_and_observe
    try:
        yield outputs
    finally:
        del scheduler.schedule  # the class's method again


def dry_run(scheduler: Any, arrivals: Mapping[int, Sequence[Request]], *, max_steps: int = 10_000,
            token: int = 7) -> list[StepRecord]:
    """Drive a stage 3 or 4 ``scheduler`` with token ids alone (``dry_run_step``: a request that completes its
    known tokens samples ``token``) until every request finished; ``arrivals``: the requests added before
    each step. Records every step, on the steps clock."""
    from stage3_continuous.dry_run import dry_run_step

    observer = StepObserver.for_scheduler(scheduler, clock="steps", capacity=max_steps)
    for step in range(max_steps):
        for request in arrivals.get(step, ()):
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests():
            if step > max(arrivals, default=0):
                break
            continue
        with watching(scheduler, observer):
            output = dry_run_step(scheduler, token)
        observer.stepped(output, None, scheduler)
    return observer.drain().records if len(observer.buffer) else []


class StaticBatchRecorder:
    """Stages 1 and 2 from outside: a batch runs until its last member ends. Stage 1's slab is drawn as
    block-sized cells (``cell_size``: the engine's block size, else 16 slots): a request's reservation
    covers its cells from admission, *reserved* until a token is written into them."""

    def __init__(self, engine: Any, cell_size: int | None = None, clock: str = "seconds"):
        self.engine = engine
        self.slab = not hasattr(engine, "block_tables")  # stage 1
        self.cell_size = cell_size or getattr(engine, "block_size", 16)
        cache = engine.kv_cache
        self.num_cells = -(-cache.num_slots // self.cell_size) if self.slab else engine.allocator.num_blocks
        self.tracker = BlockTracker(self.num_cells)  # stage 2's blocks
        self.cells: dict[str, list[int]] = {}  # stage 1: each reservation's cells
        self.written_cells: dict[str, int] = {}  # ... and how many of them hold a written token
        self.clock = clock
        self.step_no = 0
        self.first_token_at: dict[str, int] = {}

    def step(self, run: Run) -> list[StepRecord]:
        engine = self.engine
        members = [*engine.batch, *engine.waiting]
        before = {r.request_id: (r, r.num_computed_tokens, r.num_output_tokens) for r in members}
        started = time.perf_counter()
        run()
        steps = []
        for rid, (request, computed, num_output) in before.items():
            num_new = request.num_computed_tokens - computed
            if num_new <= 0:
                continue
            prefill, decode, _ = token_kinds(num_new, 0, computed, request.num_prompt_tokens)
            step = RequestStep(rid, prefill, decode, sampled=request.num_output_tokens - num_output,
                               computed=request.num_computed_tokens, prompt=request.num_prompt_tokens)
            self.latencies(step, request, num_output)
            steps.append(step)
        by_id = {s.id: s for s in steps}
        freed = self.slab_cells(by_id) if self.slab else self.block_cells(by_id)
        self.step_no += 1
        used = sum(map(len, self.cells.values())) if self.slab else self.tracker.num_used
        return [StepRecord(
            step=self.step_no, time=float(self.step_no) if self.clock == "steps" else round(time.monotonic(), 6),
            duration=1.0 if self.clock == "steps" else round(time.perf_counter() - started, 6), budget=None,
            num_blocks=self.num_cells, block_size=self.cell_size, requests=steps, freed=freed,
            running=[r.request_id for r in engine.batch if not r.is_finished],
            waiting=[r.request_id for r, _ in zip(engine.waiting, range(MAX_WAITING_IDS))],
            num_waiting=len(engine.waiting), free=self.num_cells - used, used=used)]

    def latencies(self, step: RequestStep, request: Any, num_output_before: int) -> None:
        times = request.timeline.token_times
        if num_output_before == 0 and step.sampled:
            self.first_token_at[step.id] = self.step_no + 1
            step.ttft = float(self.step_no + 1) if self.clock == "steps" else round(times[0] - request.arrival_time, 6)
        if request.is_finished:
            step.finish = request.status.finish_reason
            first = self.first_token_at.pop(step.id, self.step_no + 1)
            if len(times) > 1:
                step.tpot = round(((self.step_no + 1 - first) if self.clock == "steps"
                                   else times[-1] - times[0]) / (len(times) - 1), 6)

    def block_cells(self, by_id: dict[str, RequestStep]) -> list[FreedBlocks]:
        """Stage 2: the engine's block tables, through the tracker (no prefix cache)."""
        grown, freed = self.tracker.update(self.engine.live_block_ids(), int, lambda rid: 0, None,
                                           lambda rid: "finished")
        for rid, (new, _, _, _) in grown.items():
            if rid in by_id:
                by_id[rid].new = tuple(new)
        return freed

    def slab_cells(self, by_id: dict[str, RequestStep]) -> list[FreedBlocks]:
        """Stage 1: each reservation's cells; those holding a written token are used, the rest reserved."""
        cache, size, freed = self.engine.kv_cache, self.cell_size, []
        for rid in [rid for rid in self.cells if rid not in cache.reservations]:
            del self.written_cells[rid]
            freed.append(FreedBlocks(rid, self.cells.pop(rid)))
        for rid, extent in cache.reservations.items():
            first = extent.start // size
            cells = list(range(first, -(-(extent.start + extent.length) // size)))
            step = by_id.get(rid)
            if rid not in self.cells:
                self.written_cells[rid] = 0
                self.cells[rid] = cells
                if step is not None:
                    step.reserved = tuple(cells)
            written = -(-cache.written.get(rid, 0) // size)
            if written > self.written_cells[rid] and step is not None:
                step.new = tuple(cells[self.written_cells[rid]:written])
                step.reserved = tuple(c for c in step.reserved if c not in step.new)
            self.written_cells[rid] = written
        return freed
