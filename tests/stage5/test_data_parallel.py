"""Data parallelism and several API servers: N engine cores behind a coordinator, A API servers on one port.

- routing (model-free): least loaded with ties to the lowest rank, the A x in-flight floor, prefix
  affinity that yields to a much busier rank, keys salted like the prefix cache;
- the process count: the seeds' A + DP + N (+1 coordinator), as stagedserve maps it;
- two engine cores from one front end (this process): greedy and seeded outputs equal to one
  engine, aborts reach the rank that holds the request, two API servers over the same cores share a
  trust group's cached prefix and nothing across groups, every rank in /metrics, and a killed rank
  fails only the requests it held;
- ``stagedserve serve --data-parallel-size 2 --api-server-count 2`` as real processes (slow): the
  process tree against the formula, the same tokens as one engine, per-request metrics summed over
  the API servers, a killed API server or engine core under load, and a SIGTERM that drains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from shared import SamplingParams
from stage5_server.cli import make_parser
from stage5_server.cli.serve import resolve_topology, serving_process_count
from stage5_server.core.stats import SchedulerStats
from stage5_server.data_parallel.launcher import plan_devices
from stage5_server.data_parallel.routing import LEAST_LOADED, PREFIX_AFFINITY, Router, rank_load
from stage5_server.engine import EngineDeadError, EngineError, RequestAborted
from stage5_server.engine.mp_client import MPAsyncLLM, combine_stats
from stage5_server.server import create_app
from tests.reliability.engine_faults import EngineFaults
from tests.stage5.server_fixtures import (
    ENGINE_KWARGS,
    auth,
    counts_of,
    make_llm,
    metric,
    running_server,
    serving_or_exited,
    serving_processes,
    spawn_serve,
    sse_events,
    wait_until,
)

TIMEOUT_S = 120
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [f"Request {i} of the data-parallel test" for i in range(6)]
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def final(engine, prompt, params, request_id=None):
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs[-1]


# ---- routing, model-free ----------------------------------------------------------------------------------


def test_least_loaded_picks_the_smallest_load_and_breaks_ties_by_rank():
    router = Router(LEAST_LOADED, block_size=4, slack=2)
    assert router.choose({0: 3.0, 1: 1.0, 2: 1.0}, [1, 2, 3]) == 1
    assert router.choose({0: 0.0, 1: 0.0}, []) == 0
    assert router.choose({1: 0.0}, []) == 1  # only live ranks are offered


def test_a_rank_load_is_the_larger_of_its_published_queue_and_a_times_the_own_in_flight_count():
    assert rank_load(waiting=2, running=3, in_flight=1, api_server_count=2) == 5  # the publication knows more
    assert rank_load(waiting=0, running=0, in_flight=3, api_server_count=2) == 6  # the publication is behind


def test_prefix_affinity_follows_the_longest_known_prefix_until_its_rank_is_much_busier():
    router = Router(PREFIX_AFFINITY, block_size=4, slack=2)
    shared, other = [7, 7, 7, 7, 8, 8, 8, 8], [9, 9, 9, 9]
    assert router.choose({0: 0.0, 1: 0.0}, shared + [1]) == 0  # nothing known: least loaded
    assert router.choose({0: 2.0, 1: 0.0}, shared + [2]) == 0  # 2 busier is within the slack: stay
    assert router.choose({0: 1.0, 1: 0.0}, other) == 1  # another prefix: least loaded
    assert router.choose({0: 3.0, 1: 0.0}, shared[:4] + [5, 5, 5, 5]) == 1  # 3 busier: too much, move
    assert router.choose({0: 0.0, 1: 0.0}, shared[:4] + [6]) == 1  # the first block now points at rank 1
    assert router.choose({0: 0.0, 1: 0.0}, shared + [3]) == 0  # the longer prefix still points at rank 0
    assert (router.affinity_hits, router.affinity_overridden) == (3, 1)


def test_prefix_keys_cover_only_full_blocks_and_differ_by_cache_salt():
    router = Router(PREFIX_AFFINITY, block_size=4, slack=1, max_prefix_blocks=2)
    assert router.prefix_keys([1, 2, 3], None) == []
    assert len(router.prefix_keys(list(range(100)), None)) == 2
    assert router.prefix_keys([1, 2, 3, 4], "group-a") != router.prefix_keys([1, 2, 3, 4], "group-b")
    router.choose({0: 0.0, 1: 5.0}, [1, 2, 3, 4], "group-a")
    assert router.choose({0: 5.0, 1: 0.0}, [1, 2, 3, 4], "group-b") == 1  # another group's prefix is not its own


def test_the_prefix_table_is_bounded():
    router = Router(PREFIX_AFFINITY, block_size=1, slack=1, max_prefix_blocks=1, table_size=3)
    for token in range(10):
        router.choose({0: 0.0}, [token])
    assert len(router._owner) == 3


def test_combined_stats_sum_the_counts_and_average_kv_usage():
    ranks = [SchedulerStats(num_running=1, kv_cache_usage=0.5, prefix_cache_hits=3),
             SchedulerStats(num_running=2, kv_cache_usage=0.0, prefix_cache_hits=4)]
    for stats, steps in zip(ranks, ([1, 20], [20, 20, 9000])):
        for tokens in steps:
            stats.observe_step(tokens)
    total = combine_stats(ranks)
    assert (total.num_running, total.kv_cache_usage, total.prefix_cache_hits) == (3, 0.25, 7)
    # the tokens-per-step histogram bucket by bucket: 1 | three in (16, 32] | one in (8192, 16384]
    assert total.iteration_tokens_counts == (1, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0)
    assert (total.iteration_tokens_sum, total.num_steps) == (9061, 5)


# ---- the topology, model-free -----------------------------------------------------------------------------


@pytest.mark.parametrize("a, dp, tp, pp, expected", [
    (1, 1, 1, 1, dict(api_servers=1, engine_cores=1, workers=0, coordinator=0, supervisor=0, total=2)),
    (1, 1, 2, 1, dict(api_servers=1, engine_cores=1, workers=2, coordinator=0, supervisor=0, total=4)),
    (1, 2, 2, 1, dict(api_servers=1, engine_cores=2, workers=4, coordinator=1, supervisor=0, total=8)),
    (2, 2, 1, 1, dict(api_servers=2, engine_cores=2, workers=0, coordinator=1, supervisor=1, total=6)),
    (1, 1, 1, 2, dict(api_servers=1, engine_cores=1, workers=2, coordinator=0, supervisor=0, total=4)),
    (1, 2, 2, 2, dict(api_servers=1, engine_cores=2, workers=8, coordinator=1, supervisor=0, total=12)),
])
def test_the_serving_process_count_is_the_seeds_formula_with_the_model_inside_a_tp1_engine_core(a, dp, tp, pp,
                                                                                                 expected):
    assert serving_process_count(a, dp, tp, pp) == expected


def test_the_api_server_count_defaults_to_the_data_parallel_size_and_needs_the_engine_process():
    for argv, count in ((["serve"], 1), (["serve", "--data-parallel-size", "3"], 3),
                        (["serve", "--data-parallel-size", "3", "--api-server-count", "1"], 1)):
        args = make_parser().parse_args(argv)
        resolve_topology(args)
        assert args.api_server_count == count
    args = make_parser().parse_args(["serve", "--data-parallel-size", "2", "--no-engine-process"])
    with pytest.raises(ValueError, match="^engine_process: "):
        resolve_topology(args)


def test_each_cpu_rank_gets_its_share_of_the_cores_and_its_tp_workers_split_it(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert plan_devices({"device": "cpu"}, 2) == [{"OMP_NUM_THREADS": "4"}] * 2
    assert plan_devices({"device": "cpu", "tensor_parallel_size": 2}, 2) == [{"OMP_NUM_THREADS": "2"}] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's choice wins
    assert plan_devices({"device": "cpu"}, 4) == [{"OMP_NUM_THREADS": "1"}] * 4


def test_each_cuda_rank_gets_its_own_gpus_and_too_few_are_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6")
    assert plan_devices({"device": "cuda", "tensor_parallel_size": 2}, 2) == \
        [{"CUDA_VISIBLE_DEVICES": "3,4"}, {"CUDA_VISIBLE_DEVICES": "5,6"}]
    assert plan_devices({"device": "cuda", "pipeline_parallel_size": 2}, 2) == \
        [{"CUDA_VISIBLE_DEVICES": "3,4"}, {"CUDA_VISIBLE_DEVICES": "5,6"}]  # a stage per GPU
    with pytest.raises(ValueError, match="^data_parallel_size: 3 ranks x 2 model-parallel ranks need 6 GPUs; 4"):
        plan_devices({"device": "cuda", "tensor_parallel_size": 2}, 3)
    with pytest.raises(ValueError, match="^device: "):
        plan_devices({"device": "cuda:1"}, 2)


# ---- two engine cores behind this process -----------------------------------------------------------------


# The tests over the module's two engine cores run on one xdist worker (make test's --dist loadgroup): one start-up.
ONE_ENGINE = pytest.mark.xdist_group("data-parallel-engine")


@pytest.fixture(scope="module")
def dp(tiny_llama):
    engine = MPAsyncLLM(str(tiny_llama), data_parallel_size=2, log_stats_interval=None, startup_timeout_s=300,
                               **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return make_llm(tiny_llama)


@ONE_ENGINE
def test_two_engine_cores_give_the_tokens_of_one_and_both_do_work(dp, offline):
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=3)
    cases = [(p, GREEDY) for p in PROMPTS] + [(p, seeded) for p in PROMPTS[:2]]
    before = {d: s.num_generation_tokens for d, s in dp.stats_by_engine.items()}

    async def scenario():
        return await asyncio.gather(*[final(dp, p, params) for p, params in cases])

    outputs = run(scenario())
    expected = offline.generate([p for p, _ in cases], [params for _, params in cases], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e.outputs[0].token_ids for e in expected]
    assert [o.outputs[0].text for o in outputs] == [e.outputs[0].text for e in expected]
    assert wait_until(lambda: all(dp.stats_by_engine[d].num_generation_tokens > before[d] for d in (0, 1)))
    assert dp.in_flight_by_engine == {0: 0, 1: 0}


@ONE_ENGINE
def test_an_abort_reaches_the_rank_that_holds_the_request(dp):
    async def scenario():
        streams = [await dp.add_request(f"abort me {i}", LONG, f"abort-{i}") for i in range(2)]
        for stream in streams:
            await stream.get()  # both running
        ranks = {dp.rank_of(s.request_id) for s in streams}
        dp.abort("abort-1")
        with pytest.raises(RequestAborted):
            await streams[1].get()
        dp.abort("abort-0")
        return ranks

    assert run(scenario()) == {0, 1}  # one on each rank, and each abort found its request
    assert wait_until(lambda: all(s.num_running == 0 and s.kv_cache_usage == 0 for s in dp.stats_by_engine.values()))


@ONE_ENGINE
def test_prefix_affinity_keeps_a_prefix_on_one_rank_where_least_loaded_spreads_it(dp):
    affinity = MPAsyncLLM.connect(dataclasses.replace(dp.topology, routing=PREFIX_AFFINITY), client_index=1,
                          log_stats_interval=None)
    prefixes = {name: [token] * 32 for name, token in (("a", 11), ("b", 12))}

    async def ranks_of(engine) -> dict[str, set[int]]:
        seen: dict[str, set[int]] = {"a": set(), "b": set()}
        streams = []
        for name, prefix in prefixes.items():  # all of a's, then all of b's
            for i in range(3):
                stream = await engine.add_request(prefix + [40 + i], LONG)
                seen[name].add(engine.rank_of(stream.request_id))
                streams.append(stream)
        engine.abort([s.request_id for s in streams])
        return seen

    try:
        with_affinity = run(ranks_of(affinity))
        spread = run(ranks_of(dp))
    finally:
        affinity.shutdown()
    assert with_affinity == {"a": {0}, "b": {1}}
    assert spread == {"a": {0, 1}, "b": {0, 1}}


KEYS = {"key-a1": "group-a", "key-a2": "group-a", "key-b": "group-b"}


@ONE_ENGINE
def test_two_api_servers_share_a_groups_cached_prefix_and_nothing_across_groups(dp):
    """Two front ends (two API servers) over the same two engine cores, with one salt secret."""
    secret = os.urandom(32)
    second = MPAsyncLLM.connect(dataclasses.replace(dp.topology, api_server_count=2), client_index=1,
                        log_stats_interval=None)
    prompt = list(range(20, 60))  # 40 tokens: two full blocks of 16 can be cached
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    try:
        apps = [create_app(engine, api_keys=KEYS, served_model_name="m", cache_salt_secret=secret)
                for engine in (dp, second)]
        assert apps[0].state.serving.salter.salt("group-a") == apps[1].state.serving.salter.salt("group-a")
        with running_server(apps[0]) as one, running_server(apps[1]) as two:
            def cached(url: str, key: str) -> int:
                response = httpx.post(f"{url}/v1/completions", json=body, headers=auth(key), timeout=TIMEOUT_S)
                assert response.status_code == 200, response.text
                return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            def settled() -> bool:
                """Both API servers see both ranks idle, so least-loaded picks rank 0. The two views must also
                be equal: the coordinator can deliver to one API server stats older than the last request
                (its counters then differ), and an idle-looking stale view would route on stale loads."""
                views = [engine.stats_by_engine for engine in (dp, second)]
                return views[0] == views[1] and all(
                    stats.num_running == stats.num_waiting == 0 and engine.in_flight_by_engine[rank] == 0
                    for engine, view in zip((dp, second), views) for rank, stats in view.items())

            assert wait_until(settled) and cached(one.url, "key-a1") == 0
            # The same group through the other API server, then another group: never.
            assert wait_until(settled) and cached(two.url, "key-a2") == 32
            assert wait_until(settled) and cached(two.url, "key-b") == 0
            def scrape(url: str) -> str:
                return httpx.get(f"{url}/metrics", headers=auth("key-b"), timeout=10).text

            for server in (one, two):
                # Engine counters come with each core's newest stats, which can trail its last outputs.
                assert wait_until(lambda url=server.url: metric(scrape(url), "vllm:prefix_cache_hits_total") >= 32)
                text = scrape(server.url)
                assert {metric(text, "vllm:prefix_cache_queries_total", engine=str(d)) is not None
                        for d in (0, 1)} == {True}  # every rank, from either API server
                assert metric(text, "vllm:prefix_cache_hits_total") >= 32
    finally:
        second.shutdown()


def test_one_engine_core_behind_two_api_servers_tells_both_its_stats_without_a_coordinator(tiny_llama, offline):
    one = MPAsyncLLM(str(tiny_llama), data_parallel_size=1, log_stats_interval=None, startup_timeout_s=300,
                            **ENGINE_KWARGS)
    assert one.topology.stats_address is None  # DP = 1: nothing to balance, no coordinator
    other = MPAsyncLLM.connect(dataclasses.replace(one.topology, api_server_count=2), client_index=1,
                       log_stats_interval=None)
    try:
        out = run(final(one, PROMPTS[0], GREEDY))
        expected = offline.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == expected.token_ids
        # The other API server sent nothing, yet its /metrics numbers follow the engine core.
        assert wait_until(lambda: other.stats_by_engine[0].num_generation_tokens == GREEDY.max_tokens, timeout=10)
    finally:
        other.shutdown()
        one.shutdown()


@ONE_ENGINE
def test_a_killed_rank_fails_only_its_requests_and_the_other_serves_on(dp, offline):
    """Kills both ranks of the module's engine: keep this test last."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    expected = offline.generate(["survivor"], params, use_tqdm=False)[0].outputs[0].token_ids

    async def scenario():
        streams = {}
        for request_id in ("first", "second"):  # one on each rank
            stream = await dp.add_request("survivor", params, request_id)
            await stream.get()
            streams[dp.rank_of(request_id)] = stream
        os.kill(dp.engine_pids[1], signal.SIGKILL)
        with pytest.raises(EngineError, match="engine core rank 1 died") as lost:
            async for _ in streams[1]:
                pass
        survivor = [out async for out in streams[0]][-1]
        return lost.value, survivor

    lost, survivor = run(scenario())
    assert not isinstance(lost, EngineDeadError)  # a 500 for that request, not a 503 for the server
    assert survivor.outputs[0].token_ids == expected and survivor.outputs[0].finish_reason == "length"
    assert dp.is_running and dp.live_ranks() == [0]
    again = run(final(dp, "survivor", params))
    assert again.outputs[0].token_ids == expected  # new requests go to rank 0
    assert dp.stats_by_engine[1].num_running == 0
    os.kill(dp.engine_pids[0], signal.SIGKILL)
    assert wait_until(lambda: not dp.is_running, timeout=10)
    with pytest.raises(EngineDeadError):
        run(dp.add_request("nobody left", GREEDY))


# ---- stagedserve serve: real processes --------------------------------------------------------------------

KEY = "dp-key"


def start(tiny_llama, tmp_path, *flags: str, env: dict | None = None):
    log = (tmp_path / "serve.log").open("w+")
    process, url = spawn_serve(tiny_llama, log, "--max-model-len", "512", "--num-kv-blocks", "96",
                               "--log-stats-interval", "0", *flags, env={"STAGEDSERVE_API_KEY": KEY, **(env or {})})
    assert wait_until(serving_or_exited(process, url), timeout=300, interval=0.3) and process.poll() is None, \
        log.seek(0) or log.read()[-4000:]
    return process, url, log


def stop_and_check_nothing_is_left(process: subprocess.Popen, pids: list[int], sig=signal.SIGTERM) -> int:
    """Signal the server (``sig=None``: it was signalled already), wait for it, and check every pid is gone."""
    if sig is not None and process.poll() is None:
        process.send_signal(sig)
    try:
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert wait_until(lambda: not [p for p in left if psutil.pid_exists(p)], timeout=20), f"left behind: {left}"
    return code


async def complete(url: str, prompts: list, max_tokens: int, stream: bool = False) -> list:
    """One request per prompt, all at once; each a response or the exception it raised."""
    body = {"model": None, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    async with httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=TIMEOUT_S) as client:
        async def one(prompt):
            payload = {k: v for k, v in {**body, "prompt": prompt}.items() if v is not None}
            if not stream:
                return await client.post("/v1/completions", json=payload)
            async with client.stream("POST", "/v1/completions", json=payload) as response:
                return response.status_code, [line async for line in response.aiter_lines()]

        return await asyncio.gather(*[one(p) for p in prompts], return_exceptions=True)


def streamed_text(lines: list[str]) -> tuple[str, dict | None]:
    events = sse_events(lines)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    return text, errors[0]["error"] if errors else None


def served_by(log, before: int) -> dict[int, int]:
    """How many completions each API server answered since offset ``before`` of the log."""
    log.seek(before)
    found = re.findall(r"\[api-server (\d+) pid \d+\] .*POST /v1/completions", log.read())
    return {int(i): found.count(i) for i in set(found)}


LONG_PROMPT = "Tell me a long story about the scheduler"
LONG_TOKENS = 150
STEP_DELAY_S = 0.02  # every step of the served engine cores: a long request is still in flight when a fault strikes


@pytest.fixture(scope="module")
def long_text(tiny_llama) -> str:
    params = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
    llm = make_llm(tiny_llama, max_model_len=512)  # as served below
    return llm.generate([LONG_PROMPT], params, use_tqdm=False)[0].outputs[0].text


def long_body(stream: bool) -> dict:
    return {"prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}


async def open_streams(url: str, n: int, stack) -> list:
    """``n`` streams on fresh connections, each past its first chunk; their line iterators."""
    client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=TIMEOUT_S))
    streams = []
    for _ in range(n):
        response = await stack.enter_async_context(client.stream("POST", "/v1/completions", json=long_body(True)))
        assert response.status_code == 200
        lines = response.aiter_lines()
        first = await anext(lines)
        streams.append((first, lines))
    return streams


async def read_rest(first: str, lines) -> tuple[str | None, dict | None]:
    """The whole text and error of a stream, or (None, None) when its connection broke."""
    try:
        rest = [line async for line in lines]
    except httpx.HTTPError:
        return None, None
    return streamed_text([first, *rest])


async def kill_api_server_under_load(url: str, victim: int, other: int) -> dict:
    """Two streams on each API server (the other one paused while a connection is accepted), then kill -9 one."""
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        held = {}
        for holder, paused in ((other, victim), (victim, other)):
            os.kill(paused, signal.SIGSTOP)  # a stopped process accepts nothing: the holder gets the connections
            try:
                held[holder] = await open_streams(url, 2, stack)
            finally:
                os.kill(paused, signal.SIGCONT)
        os.kill(victim, signal.SIGKILL)
        return {holder: await asyncio.gather(*[read_rest(*s) for s in streams]) for holder, streams in held.items()}


async def kill_rank_under_load(url: str, rank_pid: int, n: int = 6) -> dict:
    async with httpx.AsyncClient(base_url=url, headers=auth(KEY), timeout=TIMEOUT_S) as client:
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=long_body(False))) for _ in range(n)]
        deadline = time.monotonic() + 60
        while True:  # every request running, and the coordinator's numbers settled
            text = (await client.get("/metrics")).text
            held = {d: (metric(text, "vllm:num_requests_running", engine=d) or 0)
                    + (metric(text, "vllm:num_requests_waiting", engine=d) or 0) for d in ("0", "1")}
            if sum(held.values()) == n:
                break
            assert time.monotonic() < deadline, held
            await asyncio.sleep(0.05)
        os.kill(rank_pid, signal.SIGKILL)
        return {"on_rank_1": held["1"], "responses": await asyncio.gather(*tasks)}


async def sigterm_while_streaming(url: str, process: subprocess.Popen) -> dict:
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        streams = await open_streams(url, 2, stack)
        process.send_signal(signal.SIGTERM)
        refused = False
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:  # every copy of the socket closes soon
            await asyncio.sleep(0.2)
            try:
                async with httpx.AsyncClient(timeout=2) as fresh:
                    await fresh.get(f"{url}/health")
            except httpx.ConnectError:
                refused = True
        return {"refused": refused, "streams": await asyncio.gather(*[read_rest(*s) for s in streams])}


@pytest.mark.slow
def test_two_api_servers_over_two_engine_cores_serve_survive_faults_and_drain(tiny_llama, tmp_path, offline,
                                                                             long_text):
    faults = EngineFaults(tmp_path / "faults")
    faults.slow_steps(STEP_DELAY_S)
    process, url, log = start(tiny_llama, tmp_path, "--data-parallel-size", "2", "--api-server-count", "2",
                              "--shutdown-timeout", "30", "--uvicorn-log-level", "info", env=faults.env)
    root = psutil.Process(process.pid)
    try:
        # /health answers once one API server is up; the other may not have named itself yet.
        assert wait_until(lambda: sorted(p.name() for p in serving_processes(root).get("api_servers", []))
                          == ["ss-api-0", "ss-api-1"], timeout=30)
        roles = serving_processes(root)
        assert counts_of(roles) == serving_process_count(2, 2, 1)  # 2 + 2 + 0 + 1 coordinator, + the supervisor
        api = {p.name(): p.pid for p in roles["api_servers"]}
        ranks = {p.name(): p.pid for p in roles["engine_cores"]}

        # The same greedy tokens as one engine, whichever API server and rank answered.
        expected = [o.outputs[0].text for o in offline.generate(PROMPTS, GREEDY, use_tqdm=False)]
        responses = run(complete(url, PROMPTS * 2, GREEDY.max_tokens))
        assert [r.json()["choices"][0]["text"] for r in responses] == expected * 2

        # Per-request metrics are summed over both API servers; engine numbers are one series per rank.
        assert wait_until(lambda: sum(served_by(log, 0).values()) == len(PROMPTS) * 2, timeout=10)
        def scrape() -> str:  # reaches either API server: each tells the whole story
            return httpx.get(f"{url}/metrics", headers=auth(KEY), timeout=10).text

        # Engine counters come with each core's newest stats, which can trail its last outputs.
        generated = len(PROMPTS) * 2 * GREEDY.max_tokens
        assert wait_until(lambda: all(metric(scrape(), "vllm:generation_tokens_total") == generated
                                      for _ in range(4)), timeout=10)
        for _ in range(4):
            text = scrape()
            assert metric(text, "vllm:request_success_total", finished_reason="length") == len(PROMPTS) * 2
            assert metric(text, "vllm:e2e_request_latency_seconds_count") == len(PROMPTS) * 2
            assert metric(text, "vllm:generation_tokens_total") == generated
            assert all(metric(text, "vllm:generation_tokens_total", engine=d) > 0 for d in ("0", "1"))

        # kill -9 one API server while each holds two streams: its streams break, the other's finish
        # with the right text, the engine cores abort its requests at once, and it is restarted.
        held = asyncio.run(kill_api_server_under_load(url, api["ss-api-0"], api["ss-api-1"]))
        assert held[api["ss-api-0"]] == [(None, None)] * 2
        assert held[api["ss-api-1"]] == [(long_text, None)] * 2
        assert wait_until(lambda: idle(url), timeout=30)
        log.seek(0)
        aborted = re.findall(rf"API server api0-{api['ss-api-0']} is gone .*aborting its (\d+) request", log.read())
        assert sum(map(int, aborted)) == 2, aborted  # by the engine cores that held them
        assert wait_until(lambda: len(serving_processes(root).get("api_servers", [])) == 2, timeout=120)
        assert metric(httpx.get(f"{url}/metrics", headers=auth(KEY), timeout=10).text,
                      "vllm:request_success_total", finished_reason="length") >= len(PROMPTS) * 2  # none lost

        # kill -9 one engine core under load: exactly its requests fail (500 engine_error), the others finish.
        outcome = asyncio.run(kill_rank_under_load(url, ranks["ss-engine-1"]))
        statuses = [r.status_code for r in outcome["responses"]]
        failed = [r.json()["error"] for r in outcome["responses"] if r.status_code != 200]
        assert statuses.count(500) == outcome["on_rank_1"] >= 1 and statuses.count(200) >= 1, statuses
        assert all(e["code"] == "engine_error" and "rank 1" in e["message"] for e in failed), failed
        assert all(r.json()["choices"][0]["text"] == long_text for r in outcome["responses"] if r.status_code == 200)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        after = run(complete(url, PROMPTS[:4], GREEDY.max_tokens))
        assert [r.json()["choices"][0]["text"] for r in after] == expected[:4]

        # SIGTERM drains: streams in flight finish, new connections are refused, nothing is left behind.
        pids = [p.pid for ps in serving_processes(root).values() for p in ps]
        drained = asyncio.run(sigterm_while_streaming(url, process))
        assert drained["refused"] and drained["streams"] == [(long_text, None)] * 2
        assert stop_and_check_nothing_is_left(process, pids, sig=None) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_one_api_server_over_two_tensor_parallel_engine_cores_matches_the_formula(tiny_llama, tmp_path, offline):
    process, url, log = start(tiny_llama, tmp_path, "--data-parallel-size", "2", "--api-server-count", "1",
                              "--tensor-parallel-size", "2", "--attention-backend", "torch", "--device", "cpu")
    try:
        roles = serving_processes(psutil.Process(process.pid))
        assert counts_of(roles) == serving_process_count(1, 2, 2)  # 1 + 2 + 4 workers + 1 coordinator
        pids = [p.pid for ps in roles.values() for p in ps]
        expected = [o.outputs[0].text for o in offline.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
        responses = run(complete(url, PROMPTS[:4], GREEDY.max_tokens))
        assert [r.json()["choices"][0]["text"] for r in responses] == expected
        text = httpx.get(f"{url}/metrics", headers=auth(KEY), timeout=10).text
        assert all(metric(text, "vllm:generation_tokens_total", engine=d) > 0 for d in ("0", "1"))
        assert stop_and_check_nothing_is_left(process, pids) == 0
    finally:
        if process.poll() is None:
            process.kill()


def idle(url: str) -> bool:
    text = httpx.get(f"{url}/metrics", headers=auth(KEY), timeout=10).text
    return metric(text, "vllm:kv_cache_usage_perc") == 0 and metric(text, "vllm:num_requests_running") == 0 and \
        metric(text, "vllm:num_requests_waiting") == 0
