"""The engine core in its own process (``MPAsyncLLM``): outputs identical to the in-process
engine, stop strings found in the API server and aborted in the core, start-up errors
surfaced, per-request timelines, and the death of the engine process seen by the server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time

import httpx
import psutil
import pytest
from openai import OpenAI

from shared import SamplingParams
from shared.metrics import RequestTimeline
from stage5_server.cli.serve import serving_process_count
from stage5_server.core.core_proc import ZmqCoreLoop
from stage5_server.core.messages import (
    AddRequest,
    ClientHello,
    ClientWelcome,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FailedRequests,
    encoder,
    input_decoder,
    output_decoder,
)
from stage5_server.core.request import Request
from stage5_server.core.stats import SchedulerStats
from stage5_server.engine import AsyncLLM, EngineDeadError, MPAsyncLLM, RequestAborted, make_async_llm
from stage5_server.engine.output_processor import OutputProcessor
from stage5_server.server import create_app
from stage5_server.server.metrics import request_phases
from stage5_server.server.serving import TIMELINE_HEADER
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

PROMPT = "Hello there, engine"
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
TIMEOUT_S = 60


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def final(engine, prompt, params):
    outputs = [out async for out in engine.generate(prompt, params)]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return outputs[-1]


def outputs_of(request: Request, num_sent: int) -> EngineCoreOutputs:
    return EngineCoreOutputs([EngineCoreOutput.from_request(request, num_sent)], SchedulerStats())


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---- the wire format ---------------------------------------------------------------------------


def test_a_request_crosses_the_wire_as_token_ids_with_its_id_and_parameters():
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=7, stop=["x"], stop_token_ids=[4], seed=11,
                            logprobs=2)
    request = EngineCoreRequest(request_id="cmpl-1", prompt_token_ids=[5, 6, 7], sampling_params=params,
                                arrival_time=12.5, priority=2, cache_salt="s", eos_token_ids=(2,))
    message = input_decoder.decode(encoder.encode(AddRequest(request)))
    copy = message.request.to_request()
    assert (copy.request_id, copy.prompt_token_ids, copy.sampling_params, copy.arrival_time, copy.priority,
            copy.cache_salt, copy.eos_token_ids) == ("cmpl-1", [5, 6, 7], params, 12.5, 2, "s", (2,))


def test_an_output_carries_only_the_tokens_not_sent_yet():
    request = Request("r", [1, 2], SamplingParams(max_tokens=5))
    for i, token in enumerate([10, 11, 12]):
        request.append_output_token(token, now=100.0 + i)
    wire = EngineCoreOutput.from_request(request, num_sent=1)
    assert (wire.request_id, wire.new_token_ids, wire.new_token_times, wire.finish_reason) == \
        ("r", [11, 12], [101.0, 102.0], None)


def test_the_front_ends_state_rebuilt_from_outputs_matches_the_cores_request():
    core = Request("r", [1, 2], SamplingParams(max_tokens=3, detokenize=False))
    front_end = OutputProcessor(tokenizer=None)  # nothing to decode
    front_end.add_request("r", None, [1, 2], core.sampling_params, core.arrival_time)
    for i, token in enumerate([10, 11, 12]):  # one token a step, each output sent over the wire
        num_sent = core.num_output_tokens
        core.append_output_token(token, now=100.0 + i)
        wire = output_decoder.decode(encoder.encode(outputs_of(core, num_sent))).outputs
        [(_, mirror)] = front_end.process_outputs(wire).deliveries
    assert (mirror.outputs[0].token_ids, mirror.timeline.token_times) == ([10, 11, 12], [100.0, 101.0, 102.0])


def test_request_phases_split_the_first_token_at_the_process_boundary():
    timeline = RequestTimeline(arrival=1.0, first_scheduled=1.5, token_times=[2.0, 2.25, 3.0], finished=3.0,
                               received=0.5, queued=1.25, first_delivered=2.125)
    phases = request_phases(timeline)
    assert phases == {"frontend_in": 0.75, "queue": 0.25, "prefill": 0.5, "decode": 1.0, "inference": 1.5,
                      "frontend_out": 0.125, "server_ttft": 1.625}
    assert phases["frontend_in"] + phases["queue"] + phases["prefill"] + phases["frontend_out"] == \
        phases["server_ttft"]
    assert request_phases(RequestTimeline(arrival=1.0))["prefill"] is None


def test_the_core_loop_streams_new_tokens_and_fails_in_flight_requests_when_a_step_raises(tiny_llama, monkeypatch):
    import zmq

    llm = make_llm(tiny_llama)
    context = zmq.Context()
    sockets = {name: context.socket(kind) for name, kind in (
        ("to_core", zmq.PUSH), ("core_in", zmq.PULL), ("core_out", zmq.ROUTER), ("from_core", zmq.DEALER))}
    sockets["core_out"].setsockopt(zmq.ROUTER_MANDATORY, 1)
    sockets["from_core"].setsockopt(zmq.ROUTING_ID, b"api0")
    sockets["to_core"].bind("inproc://to_core")
    sockets["core_in"].connect("inproc://to_core")
    sockets["core_out"].bind("inproc://from_core")
    sockets["from_core"].connect("inproc://from_core")
    core = ZmqCoreLoop(llm.engine, 0, sockets["core_in"], sockets["core_out"], None, os.getppid())

    def add(request_id: str) -> None:
        request = EngineCoreRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], arrival_time=time.monotonic(),
                                    sampling_params=SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        sockets["to_core"].send(encoder.encode(AddRequest(request, "api0")))
        core.handle(core.receive(1.0))

    def received():
        """The next message about requests (a stats-only broadcast between steps is skipped)."""
        while True:
            assert sockets["from_core"].poll(5000)
            message = output_decoder.decode(sockets["from_core"].recv())
            if not isinstance(message, EngineCoreOutputs) or message.outputs or message.failed:
                return message

    try:
        sockets["from_core"].send(encoder.encode(ClientHello("api0")))
        core.handle(core.receive(1.0))
        assert isinstance(received(), ClientWelcome) and core.clients == {"api0"}
        add("a")
        core.step()
        core.step()
        first, second = received(), received()
        tokens = llm.engine.scheduler.requests["a"].output_token_ids
        assert len(tokens) == 2  # one per step, each sent once
        assert [o.new_token_ids for o in first.outputs + second.outputs] == [tokens[:1], tokens[1:]]
        assert second.scheduler_stats.num_running == 1

        monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
        core.step()  # an ordinary failure: the requests in flight fail, the loop keeps serving
        failed = received()
        assert failed.failed.request_ids == ["a"] and "RuntimeError" in failed.failed.error
        assert not failed.failed.engine_dead
        assert not core.stopping and not llm.engine.unfinished_request_ids()
        assert failed.scheduler_stats.num_running == 0

        add("b")
        monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(EngineDeadError("rank 1 died")))
        core.step()  # the engine cannot step again: fail, and leave the loop (the process exits non-zero)
        failed = received()
        assert failed.failed == FailedRequests(["b"], "rank 1 died", engine_dead=True)
        assert core.dead and core.stopping
    finally:
        for socket in sockets.values():
            socket.close(linger=0)
        context.term()


# ---- both modes, one engine each ---------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny model with its EOS set to a token that greedy decoding of PROMPT reaches (the 6th)."""
    tokens = make_llm(tiny_llama).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12),
                                           use_tqdm=False)[0].outputs[0].token_ids
    eos = next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    generation = path / "generation_config.json"
    if generation.exists():
        generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": eos}))
    return path


@pytest.fixture(scope="module")
def engines(eos_checkpoint):
    split = MPAsyncLLM(str(eos_checkpoint), log_stats_interval=None, startup_timeout_s=120, **ENGINE_KWARGS)
    in_process = AsyncLLM.from_llm(make_llm(eos_checkpoint), log_stats_interval=None)
    yield split, in_process
    split.shutdown()
    in_process.shutdown()


def test_greedy_outputs_are_identical_in_both_modes(engines):
    split, in_process = engines
    plain = run(final(in_process, "The scheduler runs", SamplingParams(temperature=0, max_tokens=16)))
    text, ids = plain.outputs[0].text, plain.outputs[0].token_ids
    cases = [
        ("The scheduler runs", SamplingParams(temperature=0, max_tokens=16)),  # length
        ("The scheduler runs", SamplingParams(temperature=0, max_tokens=16, stop=[text[6:9]])),  # stop string
        ("The scheduler runs", SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ids[4]])),
        (PROMPT, SamplingParams(temperature=0, max_tokens=30)),  # EOS
        ("The scheduler runs", SamplingParams(temperature=0, max_tokens=8, logprobs=3)),
        ([5, 9, 13, 17], SamplingParams(temperature=0, max_tokens=6)),
    ]
    split_outputs = []
    for prompt, params in cases:
        a, b = run(final(split, prompt, params)), run(final(in_process, prompt, params))
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.text, ca.token_ids, ca.finish_reason, ca.stop_reason) == \
            (cb.text, cb.token_ids, cb.finish_reason, cb.stop_reason), (prompt, params)
        assert ca.logprobs == cb.logprobs and (a.prompt_token_ids, a.prompt) == (b.prompt_token_ids, b.prompt)
        split_outputs.append(ca)
    length, stop_string, stop_token, eos, with_logprobs, _ = split_outputs
    assert (length.finish_reason, length.stop_reason, len(length.token_ids)) == ("length", None, 16)
    assert (stop_string.finish_reason, stop_string.stop_reason) == ("stop", text[6:9])
    assert text[6:9] not in stop_string.text and text.startswith(stop_string.text)
    assert (stop_token.finish_reason, stop_token.stop_reason, stop_token.token_ids) == ("stop", ids[4], ids[:5])
    assert (eos.finish_reason, eos.stop_reason, len(eos.token_ids)) == ("stop", None, 6)
    assert len(with_logprobs.logprobs) == 8
    assert all(entry[t].decoded_token is not None for t, entry in zip(with_logprobs.token_ids, with_logprobs.logprobs))


def test_structured_output_crosses_the_wire_and_the_core_process_builds_its_grammar(engines):
    split, in_process = engines
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={
        "json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["n"]}})
    a, b = run(final(split, "The scheduler runs", params)), run(final(in_process, "The scheduler runs", params))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert 0 <= json.loads(a.outputs[0].text)["n"] <= 99 and a.outputs[0].finish_reason == "stop"
    bad = SamplingParams(structured_outputs={"regex": "a{2,1}"})
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: "):  # refused in the API server
        run(split.add_request("x", bad))


def test_a_stop_string_found_in_the_api_server_aborts_the_request_in_the_core(engines):
    split, in_process = engines
    reference = run(final(in_process, "The scheduler runs", SamplingParams(temperature=0, max_tokens=8)))
    stop = reference.outputs[0].text[4:7]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop])
    before = split.stats.num_generation_tokens
    output = run(final(split, "The scheduler runs", params))
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == stop
    assert wait_until(lambda: split.stats.num_running == 0, timeout=10)
    assert split.stats.num_generation_tokens - before < 50  # stopped long before max_tokens
    assert split.stats.kv_cache_usage == 0.0


def test_abort_frees_the_request_in_the_core_and_ends_its_stream(engines):
    split, _ = engines

    async def scenario():
        stream = await split.add_request("to abort", LONG, "abort-me")
        first = await stream.get()
        assert first.request_id == "abort-me" and not first.finished  # the id, end to end
        split.abort("abort-me")
        with pytest.raises(RequestAborted):
            await stream.get()

    run(scenario())
    assert wait_until(lambda: split.stats.num_running == 0 and split.stats.kv_cache_usage == 0.0, timeout=10)


def test_bad_input_is_refused_before_it_reaches_the_core(engines):
    split, _ = engines
    for prompt, field in (([], "prompt"), ([10**9], "prompt"), (list(range(1, 300)), "prompt")):
        with pytest.raises(ValueError, match=field):
            run(split.add_request(prompt, SamplingParams(max_tokens=2)))
    assert split.is_running


@pytest.mark.slow
def test_a_bad_engine_argument_fails_start_up_with_the_childs_message(tiny_llama):
    with pytest.raises(ValueError, match="no_such_engine_arg"):
        make_async_llm(str(tiny_llama), engine_process=True, log_stats_interval=None, no_such_engine_arg=1)


# ---- the server over a split engine -----------------------------------------------------------

KEY = "split-key"
MODEL = "tiny-split"


@pytest.fixture(scope="module")
def served(tiny_llama):
    reference = make_llm(tiny_llama).generate([PROMPT], SamplingParams(temperature=0, max_tokens=10),
                                              use_tqdm=False)[0].outputs[0]
    engine = MPAsyncLLM(str(tiny_llama), log_stats_interval=None, startup_timeout_s=120, **ENGINE_KWARGS)
    app = create_app(engine, api_keys=[KEY], served_model_name=MODEL)
    try:
        with running_server(app) as server:
            yield {"url": server.url, "engine": engine, "reference": reference}
    finally:
        engine.shutdown()


def test_the_server_over_a_split_engine_streams_what_the_offline_engine_generates(served):
    with OpenAI(base_url=f"{served['url']}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S) as client:
        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
        chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == served["reference"].text
    assert whole.usage.completion_tokens == len(served["reference"].token_ids)


def test_an_opted_in_request_gets_its_server_timeline_and_metrics_get_the_phases(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=served["url"], headers=auth(KEY), timeout=TIMEOUT_S) as client:
        plain = client.post("/v1/completions", json=body).json()
        timed = client.post("/v1/completions", json=body, headers={TIMELINE_HEADER: "1"}).json()
        lines = client.post("/v1/completions", json={**body, "stream": True},
                            headers={TIMELINE_HEADER: "1"}).text.splitlines()
        metrics = client.get("/metrics").text
    assert "server_timeline" not in plain  # standard clients see standard bodies
    events = [e for e in sse_events(lines) if e != "[DONE]"]
    final_chunk = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
    for phases in (timed["server_timeline"], final_chunk["server_timeline"]):
        assert all(phases[k] is not None and phases[k] >= 0 for k in phases)
        parts = phases["frontend_in"] + phases["queue"] + phases["prefill"] + phases["frontend_out"]
        assert parts == pytest.approx(phases["server_ttft"], abs=1e-6)
    assert not any("server_timeline" in e for e in events if e is not final_chunk)
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "stagedserve:request_frontend_in_time_seconds", "stagedserve:request_frontend_out_time_seconds"):
        assert metric(metrics, f"{name}_count", model_name=MODEL) >= 3, name
    assert metric(metrics, "vllm:generation_tokens_total", model_name=MODEL) >= 18  # stats from the core
    # Across the process boundary too: the core's step histogram, preemption counts, its KV-cache configuration.
    steps = metric(metrics, "vllm:iteration_tokens_total_sum", model_name=MODEL)
    assert steps == metric(metrics, "vllm:prompt_tokens_total") + metric(metrics, "vllm:generation_tokens_total")
    assert metric(metrics, "vllm:request_num_preemptions_count", model_name=MODEL) >= 3
    assert metric(metrics, "vllm:cache_config_info", block_size="16", num_gpu_blocks="160") == 1


# ---- the engine process dies --------------------------------------------------------------------


def test_when_the_engine_process_dies_in_flight_requests_fail_with_500_and_health_turns_503(tiny_llama):
    engine = MPAsyncLLM(str(tiny_llama), log_stats_interval=None, startup_timeout_s=120, **ENGINE_KWARGS)
    app = create_app(engine, api_keys=[KEY], served_model_name=MODEL)
    long_body = {"model": MODEL, "prompt": "a long one", "max_tokens": 200, "ignore_eos": True}
    try:
        with running_server(app) as server, httpx.Client(base_url=server.url, headers=auth(KEY),
                                                         timeout=TIMEOUT_S) as client:
            assert client.get("/health").status_code == 200

            async def scenario():
                async with httpx.AsyncClient(base_url=server.url, headers=auth(KEY), timeout=TIMEOUT_S) as ac:
                    whole = asyncio.ensure_future(ac.post("/v1/completions", json=long_body))
                    async with ac.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as resp:
                        assert resp.status_code == 200
                        lines = resp.aiter_lines()
                        async for line in lines:  # the stream is under way: kill the engine process
                            if line.startswith("data: "):
                                os.kill(engine.engine_pid, signal.SIGKILL)
                                break
                        rest = [line async for line in lines]
                    return rest, await whole

            rest, whole = run(scenario())
            events = sse_events(rest)
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert errors and errors[0]["error"]["code"] == "engine_error" and "died" in errors[0]["error"]["message"]
            assert events[-1] == "[DONE]"
            assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
            refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            with pytest.raises(EngineDeadError):
                run(engine.add_request("hi", SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown()
    assert process_gone(engine.engine_pid)


# ---- the server process: signals leave no engine process behind ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_server_leaves_no_engine_process(tiny_llama, tmp_path, sig):
    import re
    import subprocess

    log = (tmp_path / "serve.log").open("w+")
    process, url = spawn_serve(tiny_llama, log, "--engine-process", "--max-model-len", "128", "--num-kv-blocks", "16",
                               "--uvicorn-log-level", "warning")
    healthy = serving_or_exited(process, url)

    engine_pid, signalled = None, False
    try:
        assert wait_until(healthy, timeout=120, interval=0.2) and process.poll() is None, log.read()
        log.seek(0)
        engine_pid = int(re.search(r"engine core: separate process \(pid (\d+)\)", log.read()).group(1))
        assert engine_pid != process.pid and not process_gone(engine_pid)
        # The seeds' A + DP + N with A = DP = 1 and the model inside the engine core (TP = 1): two processes.
        assert counts_of(serving_processes(psutil.Process(process.pid))) == serving_process_count(1, 1, 1)
        response = httpx.post(f"{url}/v1/completions", timeout=30, json={"prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200
        # Signal the server while a stream is under way: the engine process is busy, not idle.
        stream = httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                              json={"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True})
        with stream as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(sig)
            signalled = True
            try:
                for _ in lines:
                    pass
            except httpx.HTTPError:
                pass  # a killed server just drops the connection
    finally:
        if not signalled:
            process.send_signal(sig)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        # A killed server cannot stop its engine: the engine notices its parent is gone and exits.
        gone = engine_pid is None or wait_until(lambda: process_gone(engine_pid), timeout=15)
        if not gone:
            os.kill(engine_pid, signal.SIGKILL)
    assert gone, "the engine process outlived the server"
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0)


@pytest.mark.slow
def test_serve_builds_a_split_server_by_default_and_stops_its_engine(tiny_llama, monkeypatch, caplog):
    import uvicorn

    from stage5_server.cli import main, make_parser

    assert make_parser().parse_args(["serve"]).engine_process is True  # the measured default
    assert make_parser().parse_args(["serve", "--no-engine-process"]).engine_process is False
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.append(app))
    with caplog.at_level("INFO", logger="stagedserve"):
        assert main(["serve", str(tiny_llama), "--max-model-len", "128",  # no flag: the default
                     "--num-kv-blocks", "16", "--log-stats-interval", "0"]) == 0
    [app] = served
    engine = app.state.engine
    assert isinstance(engine, MPAsyncLLM) and engine.engine_args["max_model_len"] == 128
    assert f"engine core: separate process (pid {engine.engine_pid})" in caplog.text
    assert not engine.is_running and wait_until(lambda: process_gone(engine.engine_pid), timeout=10)
