"""The inspector: step records that say what the scheduler did, bounded buffers, records that cross to the API
server from the engine process and every data-parallel rank, and a stream that shows each trust group only its
own requests' ids and text (stage5_server/inspector/)."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from shared import Request, SamplingParams
from stage3_continuous import describe_step
from stage5_server.engine import make_async_llm
from stage5_server.inspector import RecordBuffer, StepObserver, Trace, dry_run, record
from stage5_server.inspector.hub import InspectorHub, PoolView
from stage5_server.inspector.recorders import watching
from stage5_server.inspector.records import CACHED, StepRecords
from stage5_server.server import create_app
from tests.stage5.server_fixtures import REPO, auth, make_llm, running_server, wait_until

R0_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # A B C D E F G H
R1_PROMPT = [1, 2, 3, 4, 5, 6, 9, 10, 11]  # A B C D E F X Y Z
# Two API keys in two trust groups. Written so that a shared two-group fixture can replace it: the tests only
# need ``KEYS[group]`` and ``GROUPS``.
GROUPS = ("teamA", "teamB")
KEYS = {"teamA": "inspector-key-a", "teamB": "inspector-key-b"}
API_KEYS = {key: group for group, key in KEYS.items()}


# ---- the records say what the scheduler did ----------------------------------------------------------------
def dry_step(scheduler, token: int = 99):
    """``stage3_continuous.dry_run_step`` for any stage's scheduler (stage 5's output names requests by id)."""
    output = scheduler.schedule()
    requests = scheduler.requests
    done = {rid for rid, n in output.num_scheduled_tokens.items()
            if requests[rid].num_computed_tokens + n == requests[rid].num_tokens}
    scheduler.update_from_output(output, {rid: [token] if rid in done else [] for rid in output.num_scheduled_tokens})
    return output


def budget6_scheduler(stage: int, observer_kwargs: dict | None = None):
    """The seeds' worked example: R0 decoding, R1's nine-token prompt about to arrive, budget 6, blocks of 4;
    with ``observer_kwargs``, also an observer that watched it from the start."""
    from stage3_continuous import SchedulerConfig

    request = Request
    if stage == 3:
        from stage3_continuous import CacheConfig, Scheduler
    elif stage == 4:
        from stage4_prefix_cache import CacheConfig, Scheduler
    else:
        from stage4_prefix_cache import CacheConfig
        from stage5_server.core.request import Request as request
        from stage5_server.core.scheduler import Scheduler
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=4),
                          CacheConfig(block_size=4, num_blocks=16))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    observer = None if observer_kwargs is None else StepObserver.for_scheduler(scheduler, **observer_kwargs)
    scheduler.add_request(request("R0", R0_PROMPT, params))
    while scheduler.requests["R0"].num_output_tokens < 2:
        observed_step(scheduler, observer)
    scheduler.add_request(request("R1", R1_PROMPT, params))
    return scheduler if observer is None else (scheduler, observer)


def observed_step(scheduler, observer):
    if observer is None:
        return dry_step(scheduler)
    with watching(scheduler, observer):
        output = dry_step(scheduler)
    observer.stepped(output, None, scheduler)
    return output


@pytest.mark.parametrize("stage_number", [3, 4, 5])
def test_a_step_record_holds_the_schedulers_own_numbers_for_the_worked_examples_three_steps(stage_number):
    stage = stage_number
    scheduler, observer = budget6_scheduler(stage, {"clock": "steps"})
    observer.drain()  # the warm-up's
    manager = scheduler.kv_cache_manager
    described = []
    for _ in range(3):
        tables = {rid: manager.get_block_ids(rid) for rid in scheduler.requests}
        output = observed_step(scheduler, observer)
        [record] = observer.drain().records
        assert record.num_scheduled_tokens == output.num_scheduled_tokens
        assert record.total_tokens == output.total_num_scheduled_tokens and record.budget == 6
        for step in record.requests:
            now = manager.get_block_ids(step.id)
            assert [*step.hit, *step.new] == now[len(tables[step.id]):]  # the blocks the step gave it, hits first
            assert step.computed == scheduler.requests[step.id].num_computed_tokens
        assert record.free == manager.num_free_blocks and record.used == 16 - manager.num_free_blocks
        assert record.running == [r.request_id for r in scheduler.running]
        assert record.waiting == [r.request_id for r in scheduler.waiting]
        described.append(", ".join(f"{s.id} {'prefill' if s.prefill else 'decode'} {s.prefill + s.decode}"
                                   for s in record.requests))
        if stage != 5:  # stage 5's worker-side output names requests by id; describe_step reads the requests
            assert describe_step(output, 6).split(";")[0] == described[-1]
    if stage == 3:
        assert described == ["R0 decode 1, R1 prefill 5", "R0 decode 1, R1 prefill 4", "R0 decode 1, R1 decode 1"]
    else:  # prefix caching: R1's first block is a hit on R0's block 0, and its prompt needs 5 tokens, not 9
        assert described == ["R0 decode 1, R1 prefill 5", "R0 decode 1, R1 decode 1", "R0 decode 1, R1 decode 1"]


def test_prefix_hits_evictions_and_cached_blocks_are_recorded_as_the_pool_sees_them():
    from stage3_continuous import SchedulerConfig
    from stage4_prefix_cache import CacheConfig, Scheduler

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                          CacheConfig(block_size=4, num_blocks=4))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    records = dry_run(scheduler, {0: [Request("A", list(range(1, 9)), params)],  # two full blocks, then cached
                                  2: [Request("B", list(range(1, 5)) + [50, 51, 52, 53, 54], params)],  # hits one
                                  4: [Request("C", list(range(60, 75)), params)]})  # needs all four: evicts
    a, b, c = records  # each arrives, runs one step and finishes in it
    assert a.requests[0].new == (0, 1) and a.freed[0].cached == [0, 1] and a.cached == 2  # A's full blocks stay
    assert b.requests[0].hit == (0,) and b.requests[0].prefill == 5  # B's A B C D: A's block 0, back in use
    assert b.requests[0].new == (2, 3) and not b.requests[0].evicted  # the uncached blocks go first
    assert c.requests[0].new == (3, 1, 2, 0) and c.requests[0].evicted == (1, 2, 0)  # C needs the whole pool
    hashed = [blk.block_id for blk in scheduler.kv_cache_manager.block_pool.blocks if blk.block_hash is not None]
    assert c.cached == len(hashed) == 3 and sorted(c.freed[0].cached) == sorted(hashed)


class PoolLog:
    """What a stage 4 block pool did, as it did it: the blocks that went free still holding a hash, and the cached
    blocks an allocation evicted. Two methods of this one pool object are wrapped."""

    def __init__(self, pool):
        self.freed_cached: list[int] = []
        self.evicted: list[int] = []
        free_blocks, get_new_blocks = pool.free_blocks, pool.get_new_blocks

        def logged_free_blocks(blocks):
            blocks = list(blocks)
            free_blocks(blocks)
            self.freed_cached += [b.block_id for b in blocks if b.ref_cnt == 0 and b.block_hash is not None]

        def logged_get_new_blocks(num_blocks):
            head = list(itertools.islice(pool.free_block_queue, num_blocks))  # head to tail: the ones it takes
            self.evicted += [b.block_id for b in head if b.block_hash is not None]
            return get_new_blocks(num_blocks)

        pool.free_blocks, pool.get_new_blocks = logged_free_blocks, logged_get_new_blocks

    def take(self) -> tuple[list[int], list[int]]:
        done = sorted(self.freed_cached), sorted(self.evicted)
        self.freed_cached, self.evicted = [], []
        return done


def test_blocks_given_back_and_handed_out_in_one_schedule_keep_the_hash_they_had_when_given_back():
    """Step 2: R1 is preempted so that R0 can grow, and the same schedule hands R1's cached block 3 to R0, evicting
    its K/V. Step 7: R2 was aborted between steps, and the next schedule hands its blocks to R3, which fills and
    hashes them at once. Each record says what the pool did: which blocks went back cached, which were evicted.
    (Read after the schedule, the pool shows the blocks' new state, block 3 unhashed and R2's partial block 0 with
    R3's hash: a tracker that read it then missed step 2's eviction and called block 0 cached and evicted.)"""
    from stage3_continuous import RequestStatus, SchedulerConfig
    from stage4_prefix_cache import CacheConfig, Scheduler

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
                          CacheConfig(block_size=4, num_blocks=4))
    log = PoolLog(scheduler.kv_cache_manager.block_pool)
    observer = StepObserver.for_scheduler(scheduler, clock="steps")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    arrivals = {0: [Request("R0", list(range(1, 9)), params), Request("R1", list(range(20, 28)), params)],
                5: [Request("R2", list(range(40, 46)), params)],  # a full block and a partial one
                6: [Request("R3", list(range(60, 72)), params)]}  # three blocks, each full
    seen, records = [], []
    for step in range(9):
        if step == 6:
            scheduler.finish_requests("R2", RequestStatus.FINISHED_ABORTED)  # between steps: its blocks go back
        for request in arrivals.get(step, ()):
            scheduler.add_request(request)
        observed_step(scheduler, observer)
        [record] = observer.drain().records
        records.append(record)
        freed_cached = sorted(b for gone in record.freed for b in gone.cached)
        evicted = sorted(b for q in record.requests for b in q.evicted)
        assert (freed_cached, evicted) == log.take(), f"step {record.step}"
        seen.append((freed_cached, evicted, [(gone.id, gone.why) for gone in record.freed]))
    assert seen[1] == ([2, 3], [3], [("R1", "preempted")])  # R1's cached block 3, evicted by R0 at once
    assert seen[6] == ([1], [2, 3], [("R2", "aborted")])  # R2's partial block 0 went back uncached: no eviction
    assert_view_is_the_pool(view_after(records, 4), scheduler.kv_cache_manager)


def test_every_record_says_what_the_pool_did_over_random_runs_with_preemptions_aborts_and_shared_prefixes():
    """Forty random runs of stage 4's scheduler on pools of 6 to 16 blocks: prompts that share prefixes, arriving
    and aborted at random. Each record's cached frees and evictions are what the pool did that step, and the pool
    the records describe is the pool at the end."""
    from stage3_continuous import RequestStatus, SchedulerConfig
    from stage4_prefix_cache import CacheConfig, Scheduler

    for seed in range(40):
        rng = random.Random(seed)
        num_blocks = rng.randint(6, 16)
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.choice([6, 8, 16]), max_num_seqs=4),
                              CacheConfig(block_size=4, num_blocks=num_blocks))
        log = PoolLog(scheduler.kv_cache_manager.block_pool)
        observer = StepObserver.for_scheduler(scheduler, clock="steps")
        prefixes = [[rng.randint(1, 50) for _ in range(8)] for _ in range(3)]
        records, count = [], 0
        for _ in range(60):
            if rng.random() < 0.4 and count < 12:
                shared = rng.choice(prefixes)[:rng.randint(0, 8)]
                prompt = shared + [rng.randint(1, 50) for _ in range(rng.randint(1, 10))]
                params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 10), ignore_eos=True)
                scheduler.add_request(Request(f"R{count}", prompt, params))
                count += 1
            if rng.random() < 0.1 and scheduler.requests:
                scheduler.finish_requests(rng.choice(sorted(scheduler.requests)), RequestStatus.FINISHED_ABORTED)
            if scheduler.has_unfinished_requests():
                observed_step(scheduler, observer)
                for record in observer.drain().records:
                    records.append(record)
                    freed_cached = sorted(b for gone in record.freed for b in gone.cached)
                    evicted = sorted(b for q in record.requests for b in q.evicted)
                    assert (freed_cached, evicted) == log.take(), f"seed {seed}, step {record.step}"
        if set(observer.tracker.held) <= set(scheduler.kv_cache_manager.req_to_blocks):  # no abort since the last step
            assert_view_is_the_pool(view_after(records, num_blocks), scheduler.kv_cache_manager)


def view_after(records, num_blocks: int) -> PoolView:
    view = PoolView(num_blocks, 4, None)
    for step in records:
        view.apply(step)
    return view


def assert_view_is_the_pool(view: PoolView, manager) -> None:
    """The pool the records describe is the KV cache manager's: who holds each block, and which free ones are
    cached."""
    if hasattr(manager, "block_pool"):
        blocks = manager.block_pool.blocks
        assert view.refs == [b.ref_cnt for b in blocks]
        assert [s == CACHED for s in view.state] == [b.ref_cnt == 0 and b.block_hash is not None for b in blocks]
    else:
        held = [b for table in manager.tables.values() for b in table.block_ids]
        assert view.refs == [held.count(b) for b in range(view.num_blocks)]


@pytest.mark.parametrize("name", ["worked_example", "worked_example_apc", "preemption"])
def test_replaying_the_records_gives_the_pool_the_scheduler_has(name):
    sys.path.insert(0, str(REPO / "scripts"))
    import record_replays

    from stage3_continuous import CacheConfig, Scheduler, SchedulerConfig

    captured = {}
    real = record_replays.dry_run

    def capture(scheduler, arrivals, **kwargs):
        captured["scheduler"] = scheduler
        return real(scheduler, arrivals, **kwargs)

    record_replays.dry_run = capture
    try:
        trace = record_replays.TRACES[name]()
    finally:
        record_replays.dry_run = real
    manager = captured["scheduler"].kv_cache_manager
    assert_view_is_the_pool(view_after(trace.steps, trace.steps[0].num_blocks), manager)
    # ... and after every step, not only at the end: the preemption run, stopped at each step in turn
    if name == "preemption":
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                              CacheConfig(block_size=4, num_blocks=12), max_model_len=48)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for i in range(4):
            scheduler.add_request(Request(f"R{i}", [40 + i] * 6, params))
        observer = StepObserver.for_scheduler(scheduler, clock="steps")
        records = []
        while scheduler.has_unfinished_requests():
            observed_step(scheduler, observer)
            records += observer.drain().records
            assert_view_is_the_pool(view_after(records, 12), scheduler.kv_cache_manager)


def test_the_buffer_drops_the_oldest_and_says_how_many():
    buffer: RecordBuffer[int] = RecordBuffer(3)
    for i in range(5):
        buffer.append(i)
    assert buffer.drain() == ([2, 3, 4], 2) and buffer.drain() == ([], 0)
    for i in range(5, 10):
        buffer.append(i)  # numbered 5..9; 7, 8, 9 kept
    assert buffer.read(5) == ([7, 8, 9], 10, 2)  # a reader at 5 missed 5 and 6
    assert buffer.read(8) == ([8, 9], 10, 0) and buffer.read(10) == ([], 10, 0)
    with pytest.raises(ValueError, match="capacity"):
        RecordBuffer(0)


# ---- the engine core records only when asked -----------------------------------------------------------------
def test_with_the_inspector_off_the_core_holds_no_observer_and_builds_no_record(tiny_llama, monkeypatch):
    monkeypatch.setattr(StepObserver, "end", lambda *a, **k: pytest.fail("a record was built"))
    llm = make_llm(tiny_llama)
    assert llm.engine.inspector is None
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)


def test_an_inspecting_core_records_every_step_with_the_tokens_it_scheduled(tiny_llama):
    llm = make_llm(tiny_llama, enable_inspector=True, max_num_batched_tokens=8, num_kv_blocks=16, block_size=4,
                   max_model_len=64)
    llm.engine.step_trace = []
    trace = record(llm, ["one two three four five six seven", "alpha beta gamma"],
                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), arrivals=[0, 2])
    assert [r.num_scheduled_tokens for r in trace.steps] == llm.engine.step_trace
    assert [r.step for r in trace.steps] == list(range(1, len(trace.steps) + 1))
    assert all(r.total_tokens <= 8 for r in trace.steps)
    finished = [q for r in trace.steps for q in r.requests if q.finish]
    assert sorted(q.id for q in finished) == ["R0", "R1"] and all(q.tpot is not None for q in finished)
    assert trace.requests[0].output  # the text of a recorded run comes along
    # A request that finishes in the step that gave it a new block: the block is handed out, then given back.
    later = record(llm, [[5] * 22], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # 28: a new block
    assert later.steps[-1].requests[0].new and later.steps[-1].requests[0].finish == "length"
    assert_view_is_the_pool(view_after(trace.steps + later.steps, 16), llm.engine.scheduler.kv_cache_manager)


def test_the_offload_tiers_loads_and_saves_are_in_the_records(tiny_llama):
    """Six 40-token prompts, each alone, twice, through a pool that holds three of them: by the second round
    every prefix is gone from the pool, and comes back from the offload tier."""
    from stage5_server import LLM

    rng = __import__("random").Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 250) for _ in range(40)]} for _ in range(6)]
    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, enable_inspector=True, block_size=4, num_kv_blocks=32,
              max_num_seqs=2, max_model_len=64, device="cpu", dtype="float32")
    trace = record(llm, prompts * 2, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   arrivals=[12 * i for i in range(12)])
    tier = llm.engine.stats().kv_connector
    assert tier.offload_loaded_blocks > 0
    assert sum(r.offload_loaded for r in trace.steps) == tier.offload_loaded_blocks
    assert sum(r.offload_saved for r in trace.steps) == tier.offload_saved_blocks
    assert sum(len(q.loaded) for r in trace.steps for q in r.requests) == tier.offload_loaded_blocks
    assert_view_is_the_pool(view_after(trace.steps, 32), llm.engine.scheduler.kv_cache_manager)


def test_record_records_stage_3_and_stage_1_runs_from_outside(tiny_llama, tmp_path):
    from stage1_naive import LLM as SlabLLM
    from stage3_continuous import LLM as ContinuousLLM

    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = ContinuousLLM(str(tiny_llama), block_size=4, num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=8)
    trace = record(llm, [[5] * 9, [6] * 3], greedy, clock="steps")
    assert llm.engine.step_trace is None  # the engine as it was
    assert sum(q.sampled for r in trace.steps for q in r.requests) == 10
    assert Trace.load(trace.save(tmp_path / "run.json")) == trace
    slab = record(SlabLLM(str(tiny_llama), num_kv_slots=128, max_model_len=32), [[5] * 9, [6] * 3], greedy,
                  cell_size=4, clock="steps")
    assert slab.layout == "slab"
    first = slab.steps[0].requests
    assert [(q.new, len(q.reserved)) for q in first] == [((0, 1, 2), 5), ((8,), 7)]  # 8 cells each, 9 and 3 written


def test_the_record_command_writes_a_trace_the_page_replays(tiny_llama, tmp_path):
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "stage5_server.inspector", "record", "--stage", "4",
                           "--model", str(tiny_llama), "--prompt", "a b c d e f", "--prompt", "a b c d e f g",
                           "--max-tokens", "3", "--engine-arg", "block_size=4", "--engine-arg", "num_kv_blocks=32",
                           "--engine-arg", "max_model_len=64", "-o", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    trace = Trace.load(out)
    assert trace.engine == "stage4_prefix_cache" and trace.steps and trace.settings["block_size"] == 4


def test_the_replays_of_the_course_are_what_the_engines_record_now():
    sys.path.insert(0, str(REPO / "scripts"))
    import record_replays

    for name in ("worked_example", "worked_example_apc", "preemption"):  # the model-free ones; the rest: slow
        assert Trace.load(REPO / "docs" / "assets" / "replays" / f"{name}.json") == record_replays.TRACES[name](), \
            f"{name}: run python scripts/record_replays.py"


@pytest.mark.slow
def test_the_replays_that_run_a_model_are_what_the_engines_record_now():
    done = subprocess.run([sys.executable, "scripts/record_replays.py", "--check", "stage1_slab", "stage2_blocks",
                           "speculative"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- the hub: what each trust group sees ---------------------------------------------------------------------
def test_the_hub_shows_a_group_its_own_ids_and_text_and_everyone_else_under_aliases(tiny_llama):
    scheduler, observer = budget6_scheduler(4, {})
    hub = InspectorHub()
    hub.track("R0", "teamA", "A B C D E F G H")
    hub.track("R1", "teamB", "the secret of team B")
    loop = __import__("asyncio").new_event_loop()
    try:
        mine, theirs = hub.subscribe("teamA", loop), hub.subscribe("teamB", loop)
        for _ in range(3):
            observed_step(scheduler, observer)
        hub.take(0, observer.drain())
        seen = json.dumps(hub.poll(mine)) + json.dumps(hub.hello(mine))
        assert "R0" in seen and "A B C D E F G H" in seen
        assert "R1" not in seen and "secret" not in seen and re.search(r'"~[0-9a-f]{8}"', seen)
        theirs_seen = json.dumps(hub.poll(theirs)) + json.dumps(hub.hello(theirs))
        assert "R1" in theirs_seen and "the secret of team B" in theirs_seen and "A B C D" not in theirs_seen
    finally:
        loop.close()
    view = hub.views[0]  # the hub's pool agrees with the observer's
    assert [view.refs[b] for b in range(16)] == observer.tracker.refs


def test_a_page_that_falls_behind_misses_the_oldest_records_and_is_told():
    hub = InspectorHub(capacity=4)
    loop = __import__("asyncio").new_event_loop()
    try:
        slow = hub.subscribe("g", loop)
        records = [budget6_record(i) for i in range(10)]
        hub.take(0, StepRecords(records, dropped=3))
        [(name, data)] = hub.poll(slow)
        assert name == "steps" and [r["step"] for r in data["records"]] == [7, 8, 9, 10]
        assert data["dropped"] == 6 and data["engine_dropped"] == 3
    finally:
        loop.close()


def test_a_page_that_reconnects_gets_the_steps_it_missed_for_its_timeline_and_the_pool_as_it_is_now():
    hub = InspectorHub()
    loop = __import__("asyncio").new_event_loop()
    try:
        hub.take(0, StepRecords([budget6_record(i) for i in range(5)]))  # positions 0..4
        page = hub.subscribe("g", loop)
        hello = hub.hello(page, since=2)  # its last stream had read up to position 2
        assert [r["step"] for r in hello["records"]] == [3, 4, 5] and page.seq == 5 and hub.poll(page) == []
        assert hub.hello(hub.subscribe("g", loop))["records"] == []  # a new page starts from now
    finally:
        loop.close()


def budget6_record(i: int):
    from stage5_server.inspector.records import StepRecord

    return StepRecord(step=i + 1, time=float(i), duration=1.0, budget=6, num_blocks=16, block_size=4)


# ---- the server: routes, key, and the raw event stream of two trust groups ------------------------------------
@pytest.fixture(scope="module")
def inspected(tiny_llama):
    """One engine with the inspector on behind an app with two trust groups, and one without it."""
    llm = make_llm(tiny_llama, enable_inspector=True)
    app = create_app(llm, api_keys=API_KEYS, served_model_name="tiny", log_stats_interval=None)
    plain = create_app(make_llm(tiny_llama), api_keys=API_KEYS, served_model_name="tiny", log_stats_interval=None)
    with running_server(app) as on, running_server(plain) as off:
        yield {"on": on.url, "off": off.url}


def test_without_the_inspector_inspect_is_404_and_absent_from_the_schema(inspected):
    url, key = inspected["off"], KEYS["teamA"]
    for path in ("/inspect", "/inspect/events", "/inspect/static/inspector.js"):
        assert httpx.get(url + path, headers=auth(key)).status_code == 404
    schema = httpx.get(url + "/openapi.json", headers=auth(key)).json()
    assert not [p for p in schema["paths"] if p.startswith("/inspect")]


def test_the_inspector_is_behind_the_key_and_its_page_is_locked_down(inspected):
    url, key = inspected["on"], KEYS["teamA"]
    assert httpx.get(url + "/inspect").status_code == 401
    assert httpx.get(url + "/inspect/events").status_code == 401
    page = httpx.get(url + "/inspect", headers=auth(key))
    assert page.status_code == 200 and "data-inspector" in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy and "unsafe" not in policy
    script = httpx.get(url + "/inspect/static/inspector.js", headers=auth(key))
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert httpx.get(url + "/inspect/static/..%2Fhub.py", headers=auth(key)).status_code == 404
    schema = httpx.get(url + "/openapi.json", headers=auth(key)).json()
    assert {"/inspect", "/inspect/events"} <= set(schema["paths"])


def test_a_browser_may_send_the_key_as_basic_credentials_only_from_this_server(inspected):
    import base64

    url = inspected["on"]
    basic = {"Authorization": "Basic " + base64.b64encode(f"me:{KEYS['teamA']}".encode()).decode()}
    challenge = httpx.get(url + "/inspect").headers.get_list("www-authenticate")
    assert challenge == ["Bearer", 'Basic realm="stagedserve", charset="UTF-8"']
    assert httpx.get(url + "/inspect", headers={**basic, "Sec-Fetch-Site": "none"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={**basic, "Sec-Fetch-Site": "same-origin"}).status_code == 200
    for site in (None, "cross-site", "same-site"):  # another site's page, or a client that is no browser
        headers = {**basic, **({"Sec-Fetch-Site": site} if site else {})}
        assert httpx.get(url + "/inspect", headers=headers).status_code == 401
    # Only the page's routes take it: any other route still wants a bearer key.
    assert httpx.post(url + "/v1/completions", headers={**basic, "Sec-Fetch-Site": "same-origin"},
                      json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 401


def test_a_second_trust_groups_prompt_text_never_enters_the_first_groups_stream(inspected):
    url = inspected["on"]
    streams = {group: [] for group in GROUPS}
    stop = threading.Event()

    def listen(group: str) -> None:  # as a browser's EventSource does: each stream ends, the next goes on from it
        position = None
        while not stop.is_set():
            headers = {**auth(KEYS[group]), **({"Last-Event-ID": position} if position else {})}
            with httpx.stream("GET", url + "/inspect/events", headers=headers, timeout=60) as response:
                for line in response.iter_lines():
                    streams[group].append(line + "\n")
                    if line.startswith("id: "):
                        position = line[4:]
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=listen, args=(g,), daemon=True) for g in GROUPS]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: all("event: hello" in "".join(s) for s in streams.values()))
    ids = {}
    # Team B's answer is held by a grammar to a known text, so that its absence from team A's stream means something.
    secret_answer = "mango-answer-of-team-b"
    held = {"structured_outputs": {"choice": [secret_answer]}}
    for group, text, extra in (("teamA", "apricot lantern question", {}), ("teamB", "zebra-secret-of-team-b", held)):
        response = httpx.post(url + "/v1/chat/completions", headers=auth(KEYS[group]), timeout=60,
                              json={"model": "tiny", "max_tokens": 32, "messages": [{"role": "user", "content": text}],
                                    **extra})
        assert response.status_code == 200
        ids[group] = response.json()["id"]
    assert response.json()["choices"][0]["message"]["content"] == secret_answer
    assert wait_until(lambda: all(ids[g] in "".join(streams[g]) and '"finish"' in "".join(streams[g])
                                  for g in GROUPS) and "event: steps" in "".join(streams["teamA"]))
    time.sleep(0.3)  # the last frames
    stop.set()
    raw_a, raw_b = "".join(streams["teamA"]), "".join(streams["teamB"])
    assert "zebra-secret-of-team-b" not in raw_a and ids["teamB"] not in raw_a
    assert secret_answer not in raw_a  # team B's output text neither
    assert "apricot lantern question" in raw_a and "zebra-secret-of-team-b" in raw_b and secret_answer in raw_b
    events = [json.loads(line[6:]) for line in raw_a.splitlines() if line.startswith("data: ")]
    steps = [record for e in events for record in e.get("records", ())]
    other = {q["id"] for r in steps for q in r.get("requests", ()) if q["id"] != ids["teamA"]}
    assert other and all(i.startswith("~") for i in other)  # team B's request: an anonymous bar
    for thread in threads:
        thread.join(5)


@pytest.mark.slow
def test_records_cross_from_every_data_parallel_rank_to_the_api_server(tiny_llama):
    import asyncio

    engine = make_async_llm(str(tiny_llama), data_parallel_size=2, enable_inspector=True, max_model_len=256,
                            num_kv_blocks=64, log_stats_interval=None)
    got = []
    engine.step_record_sink = lambda rank, batch: got.append((rank, batch))

    async def generate(i: int) -> None:
        async for _ in engine.generate(f"prompt number {i}", SamplingParams(temperature=0, max_tokens=4),
                                       f"req-{i}"):
            pass

    async def main() -> None:
        await asyncio.gather(*(generate(i) for i in range(8)))

    try:
        asyncio.run(main())
        assert wait_until(lambda: {r for r, _ in got} == {0, 1})
        scheduled = {q.id for _, batch in got for record in batch.records for q in record.requests}
        assert scheduled == {f"req-{i}" for i in range(8)}
    finally:
        engine.shutdown()
