"""The API-server side of the split: ``MPAsyncLLM`` runs the engine core in a child process.

Same interface as the in-process ``AsyncLLM`` (``AsyncEngine``), another division of work:

    event loop (HTTP, tokenization) --add/abort--> [input socket] --> engine core process
    output thread <-- [output socket] <-- {new token ids, timestamps, finish info} per step
    output thread: detokenize, find stop strings (and abort those requests in the core),
                   build cumulative RequestOutputs, hand them to each request's stream

The child owns the scheduler, the KV cache manager and the model
(``engine_core_proc.py``); it steps while this process parses HTTP and detokenizes, so
the two no longer take turns under one GIL. Each request keeps a mirror ``Request`` here,
fed by the core's outputs, and the shared ``OutputProcessor`` turns it into text exactly
as the in-process path does: greedy outputs are identical in both modes.

Lifecycle: start-up waits for the child's ``ready`` message (or its exception, or its
death, or a timeout). The output thread watches the child's process sentinel: when the
child dies, every in-flight request fails with ``EngineError`` (a 500) and ``is_running``
turns False (``/health`` answers 503). ``shutdown`` asks the child to exit, then
terminates and kills it if it must; a finalizer does the same at interpreter exit, and
the child exits by itself when its parent disappears, so no engine process is orphaned.

vLLM: ``vllm/v1/engine/core_client.py`` (``MPClient``, ``AsyncMPClient``; ``InprocClient`` is
the in-process mode), ``vllm/v1/engine/async_llm.py`` (``output_handler``), and
``vllm/v1/engine/utils.py`` (``CoreEngineProcManager``, ``wait_for_engine_startup``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from shared.llm_base import PromptType, prompt_token_ids
from shared.metrics import SchedulerStats
from shared.output_processor import OutputProcessor
from shared.request import Request, RequestStatus
from shared.sampling_params import SamplingParams
from shared.tiny_model import default_model
from shared.tokenizer import Tokenizer
from stage3_continuous.engine import StatsLogger
from stage5_server.async_llm import (
    AsyncEngine,
    AsyncLLM,
    EngineDeadError,
    EngineError,
    RequestAborted,
    RequestStream,
)
from stage5_server.engine_core_proc import (
    FINISH_STATUS,
    decode,
    encode,
    logprobs_from_wire,
    request_to_wire,
    run_engine_core,
)
from stage5_server.server_metrics import StatLogger

logger = logging.getLogger("stagedserve")

T = TypeVar("T")
DEFAULT_STARTUP_TIMEOUT_S = 600.0


class MPAsyncLLM(AsyncEngine):
    """The engine core in a child process, driven over ZeroMQ; tokenization and detokenization here.

    ``engine_args`` are passed to stage5's ``LLM(...)`` in the child untouched. Start-up
    raises ``ValueError`` for a bad engine argument (the child's message), ``RuntimeError``
    when the child fails or dies otherwise, ``TimeoutError`` after ``startup_timeout_s``.
    """

    engine_process = True

    def __init__(self, model: str | None = None, *, log_stats_interval: float | None = 10.0,
                 stat_loggers: list[StatLogger] | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, **engine_args: Any):
        self.stat_loggers = list(stat_loggers or [])
        self._stats_log = StatsLogger(log_stats_interval) if log_stats_interval else None
        self._stats = SchedulerStats()
        self._dead: BaseException | None = None
        self._stopping = False
        self._lock = threading.Lock()  # the tokenizer, the output processor and the in-flight table
        self._input_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe
        self._requests: dict[str, tuple[Request, RequestStream]] = {}
        model_path = str(model or default_model())  # resolved once here, so both processes agree
        self._ipc_dir = tempfile.mkdtemp(prefix="stagedserve-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)  # no limit: a send only fails when no engine is connected
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        # spawn, never fork: a forked child would inherit this process's threads and torch state.
        # Not a daemon: the engine may start processes of its own (tensor parallel workers).
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="stagedserve-engine-core",
            args=(model_path, dict(engine_args), input_address, output_address, os.getpid(),
                  logger.getEffectiveLevel()))
        self._process.start()
        self._finalizer = weakref.finalize(self, _stop_process, self._process, self._ipc_dir)
        try:
            config = self._wait_until_ready(startup_timeout_s)
        except BaseException:
            self._close()
            raise
        self.model_path: str = config["model_path"]
        self.stage: str = config["stage"]
        self.max_model_len: int = config["max_model_len"]
        self.engine_args: dict[str, Any] = config["engine_args"]
        self.vocab_size: int = config["vocab_size"]
        self.eos_token_ids = tuple(config["eos_token_ids"])
        self.engine_pid: int = config["pid"]
        self.tokenizer = Tokenizer(config["tokenizer"])
        self.output_processor = OutputProcessor(self.tokenizer)
        self._thread = threading.Thread(target=self._run_output_loop, name="stagedserve-output", daemon=True)
        self._thread.start()
        logger.info("engine core running in process %d", self.engine_pid)

    # ---- start-up ------------------------------------------------------------------------------
    def _wait_until_ready(self, timeout_s: float) -> dict[str, Any]:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the engine core process did not start within {timeout_s:g} s")
            events = dict(poller.poll(remaining * 1000))
            if self._output in events:
                message = decode(self._output.recv())
                if message["type"] == "ready":
                    return message["config"]
                if message["type"] == "startup_error":
                    if message["error_type"] == "ValueError":
                        raise ValueError(message["message"])
                    raise RuntimeError(f"the engine core process failed to start: {message['error_type']}: "
                                       f"{message['message']}\n{message['traceback']}")
            elif events:  # the sentinel: the child is gone without a word
                self._process.join(1)
                raise RuntimeError(f"the engine core process exited during start-up "
                                   f"(exit code {self._process.exitcode})")

    # ---- the public API ------------------------------------------------------------------------
    @property
    def stats(self) -> SchedulerStats:
        """The engine's stats as of its latest step."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._process.is_alive()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (tokenization) here, on the caller's thread, never during detokenization."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")
        with self._lock:
            return fn(*args, **kwargs)

    async def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                          priority: int = 0, cache_salt: str | None = None,
                          received_time: float | None = None) -> RequestStream:
        """Check the request, send it to the core; return its stream (``ValueError`` names a bad field)."""
        request_id = request_id or uuid.uuid4().hex
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size, self.max_model_len)
            request = Request(request_id, token_ids, params, priority=priority, cache_salt=cache_salt,
                              eos_token_ids=self.eos_token_ids)
            request.timeline.received = received_time
            stream = RequestStream(request_id, asyncio.get_running_loop())
            self._requests[request_id] = (request, stream)
            self.output_processor.add_request(request, prompt if isinstance(prompt, str) else None)
        self._send("add", request_to_wire(request))
        return stream

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Returns at once; thread-safe."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            streams = [stream for stream in (self._forget(rid) for rid in ids) if stream is not None]
        if streams:
            self._send("abort", [s.request_id for s in streams])
            self._deliver_errors(streams, lambda rid: RequestAborted(f"request {rid} was aborted"), "abort")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core process; requests still in flight fail with ``EngineDeadError``."""
        if self._stopping:
            return
        self._stopping = True
        self._send("shutdown", None)
        self._process.join(timeout)
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the server is shutting down"), "abort")
        self._close()

    # ---- the output thread ---------------------------------------------------------------------
    def _run_output_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(100))
                if self._output in events:
                    while True:
                        try:
                            message = decode(self._output.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        self._process_outputs(message)
                elif events and not self._stopping:  # the sentinel: the child died
                    self._process.join(1)
                    self._engine_died(f"the engine core process died (exit code {self._process.exitcode})")
                    return
        except BaseException as exc:  # a bug here must fail the clients loudly, never hang them
            if self._stopping:
                return
            logger.exception("output thread crashed")
            self._engine_died(f"the output thread crashed: {exc!r}")

    def _process_outputs(self, message: dict[str, Any]) -> None:
        failed = message.get("failed")
        if failed:
            self._fail(failed["ids"], EngineError(failed["error"]), "error")
        self._stats = SchedulerStats(**message["stats"])
        deliveries: list[tuple[RequestStream, Any]] = []
        stopped: list[str] = []
        with self._lock:
            for wire in message["outputs"]:
                entry = self._requests.get(wire["id"])
                if entry is None:
                    continue  # aborted, or ended by a stop string, while the core was stepping
                request, stream = entry
                _apply(request, wire)
                if self.output_processor.update(request):  # a stop string ended it: tell the core
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.timeline.finished = request.timeline.token_times[-1]
                    stopped.append(request.request_id)
                output = self.output_processor.make_output(request.request_id)
                if output.finished:
                    self._forget(request.request_id)
                self._decode_logprob_tokens(self.tokenizer, output)
                deliveries.append((stream, output))
        if stopped:
            self._send("abort", stopped)
        self._deliver_outputs(deliveries)
        if self._stats_log is not None:
            self._stats_log.maybe_log(self._stats)

    # ---- helpers -------------------------------------------------------------------------------
    def _send(self, kind: str, payload: Any) -> None:
        """Send without blocking; with no engine process at the other end, an add fails and the rest drop."""
        with self._input_lock:
            try:
                if not self._input.closed:
                    self._input.send(encode([kind, payload]), zmq.NOBLOCK)
                    return
            except zmq.Again:
                pass
        if kind == "add":
            self._fail([payload["id"]], EngineDeadError("the engine core process is not taking requests"), "error")

    def _forget(self, request_id: str) -> RequestStream | None:
        """Drop a request from the tables (caller holds ``_lock``); return its stream."""
        entry = self._requests.pop(request_id, None)
        self.output_processor.remove(request_id)
        return None if entry is None else entry[1]

    def _fail(self, request_ids: list[str], error: BaseException, reason: str) -> None:
        with self._lock:
            streams = [s for s in (self._forget(rid) for rid in request_ids) if s is not None]
        self._deliver_errors(streams, lambda rid: error, reason)

    def _fail_all(self, error: BaseException, reason: str) -> None:
        with self._lock:
            ids = list(self._requests)
        self._fail(ids, error, reason)

    def _engine_died(self, why: str) -> None:
        logger.error("%s; failing %d in-flight request(s)", why, len(self._requests))
        self._dead = EngineDeadError(why)
        self._fail_all(EngineError(f"{why} while running this request"), "error")

    def _close(self) -> None:
        self._finalizer()  # stop the child if it still runs, remove the socket directory
        with self._input_lock:
            self._input.close()
        self._output.close()
        self._context.term()


def _apply(request: Request, wire: dict[str, Any]) -> None:
    """Bring the mirror of a request up to date with one output of the core."""
    for token_id, when in zip(wire["tokens"], wire["times"]):
        request.append_output_token(token_id, when)
    if wire["logprobs"] is not None:
        request.logprobs.extend(logprobs_from_wire(wire["logprobs"]))
    request.num_cached_tokens = wire["cached"]
    timeline = request.timeline
    timeline.queued, timeline.first_scheduled, timeline.finished = wire["queued"], wire["scheduled"], wire["finished"]
    if wire["finish"] is not None:
        request.status = FINISH_STATUS[wire["finish"]]
        request.stop_reason = wire["stop_reason"]
    elif request.status == RequestStatus.WAITING:
        request.status = RequestStatus.RUNNING


def _stop_process(process: multiprocessing.Process, ipc_dir: str, timeout: float = 5.0) -> None:
    """Make sure the child is gone: wait for a clean exit, then SIGTERM, then SIGKILL."""
    if process.is_alive():
        process.join(timeout)
    if process.is_alive():
        process.terminate()
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(timeout)
    shutil.rmtree(ipc_dir, ignore_errors=True)


def make_async_llm(model: str | None = None, *, engine_process: bool = False,
                   log_stats_interval: float | None = 10.0, **engine_args: Any) -> AsyncEngine:
    """An async engine over stage5's ``LLM``: its core in a child process (``engine_process=True``)
    or on a thread of this process (the default; notebooks and tests)."""
    if engine_process:
        return MPAsyncLLM(model, log_stats_interval=log_stats_interval, **engine_args)
    from stage5_server.llm import LLM

    return AsyncLLM(LLM(model=model, **engine_args), log_stats_interval=log_stats_interval)
