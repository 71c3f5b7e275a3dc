"""``AsyncLLM``: the offline ``LLM`` driven from a background thread, for an asyncio server.

The engine is synchronous and not thread-safe, so exactly one thread touches it: a
background "engine thread" that owns the ``LLM``. Everything else talks to that thread
through a command queue (add, abort, call) and receives each request's outputs on a
``RequestStream`` that lives on the caller's event loop. The loop on the engine thread:

    run the queued commands (block while idle) -> llm.step() -> hand each output to its stream

Outputs are cumulative (text and token ids so far), so a stream keeps only the newest
one: a consumer that falls behind skips intermediate outputs and loses nothing.

When ``llm.step()`` raises, the requests of that step fail with ``EngineError`` on their
streams and are aborted (their KV blocks go back to the pool); requests still waiting for
their turn were not in it and go on, and the loop keeps serving.

This is the in-process mode: tokenizer, detokenizer and engine core share one process and
one GIL with the HTTP event loop. ``core_client.MPAsyncLLM`` offers the same interface
(``AsyncEngine``) with the engine core in a process of its own, as vLLM V1 does.

vLLM: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``abort``), the
``RequestOutputCollector`` in ``vllm/v1/engine/output_processor.py``, and
``InprocClient`` in ``vllm/v1/engine/core_client.py`` (the engine core in the caller's process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from shared.llm_base import BaseLLM, PromptType
from shared.metrics import SchedulerStats
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from stage3_continuous.engine import StatsLogger
from stage5_server.server_metrics import StatLogger

logger = logging.getLogger("stagedserve")

T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed while running this request; the request was aborted."""


class EngineDeadError(EngineError):
    """The engine thread has stopped (shut down or crashed); no request can run."""


class RequestAborted(Exception):
    """The request was aborted before it finished (``AsyncLLM.abort``)."""


def _as_error(exc: BaseException) -> EngineError:
    """A BaseException that is no Exception, such as a Rust panic in the tokenizer (pyo3's
    ``PanicException``), fails the call that raised it like any error, not the server."""
    return EngineError(f"{type(exc).__name__}: {exc}")


class RequestStream:
    """The outputs of one request, handed from the engine thread to one event loop.

    ``put`` runs on the loop (the engine thread schedules it there); the newest output
    replaces an unread one. An error ends the stream. Iterate with ``async for``.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.finished = False  # the consumer has seen the final output or an error
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._output = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The newest output not yet returned; raises the stream's error, if any."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id}: stream already finished")
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._output is None or (self._error is not None and not self._output.finished):
            self.finished = True
            raise self._error
        out, self._output = self._output, None
        self.finished = out.finished
        return out

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


class AsyncEngine:
    """What the server uses of an engine, wherever its core runs (this process or another one).

    Subclasses provide ``add_request``, ``abort``, ``call``, ``shutdown`` and the properties
    below; streams, ``generate``, delivery to event loops and stat loggers are shared here.
    ``stat_loggers`` receive ``record_finished`` / ``record_aborted`` on the thread that
    produces outputs.
    """

    stat_loggers: list[StatLogger]
    tokenizer: Any  # use it only through ``call``
    max_model_len: int
    model_path: str
    stage: str
    engine_args: dict[str, Any]  # the resolved engine configuration
    engine_process: bool  # True: the engine core runs in a process of its own

    @property
    def stats(self) -> SchedulerStats:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        raise NotImplementedError

    async def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                          priority: int = 0, cache_salt: str | None = None,
                          received_time: float | None = None) -> RequestStream:
        raise NotImplementedError

    def abort(self, request_id: str | list[str]) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative ``RequestOutput``s until the final one (``finished=True``).

        Closing the generator early (a client that went away) aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, priority=priority, cache_salt=cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def _deliver(self, loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, Any]]) -> None:
        def put_all() -> None:
            for stream, item in items:
                stream.put(item)

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # that event loop is closed: nobody will read these
            self._abort_unread([s.request_id for s, _ in items])

    def _abort_unread(self, request_ids: list[str]) -> None:
        self.abort(request_ids)

    def _deliver_outputs(self, items: list[tuple[RequestStream, RequestOutput]]) -> None:
        """Hand outputs to their streams' loops; stamp each request's first delivery."""
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = defaultdict(list)
        for stream, output in items:
            if output.timeline.first_delivered is None:
                output.timeline.first_delivered = now
            if output.finished:
                self._record("record_finished", output)
            by_loop[stream.loop].append((stream, output))
        for loop, loop_items in by_loop.items():
            self._deliver(loop, loop_items)

    def _deliver_errors(self, streams: list[RequestStream], make_error: Callable[[str], BaseException],
                        reason: str) -> None:
        for _ in streams:
            self._record("record_aborted", reason)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = defaultdict(list)
        for stream in streams:
            by_loop[stream.loop].append((stream, make_error(stream.request_id)))
        for loop, items in by_loop.items():
            self._deliver(loop, items)

    def _record(self, method: str, *args: Any) -> None:
        for stat_logger in tuple(self.stat_loggers):  # the app may add or remove one meanwhile
            try:
                getattr(stat_logger, method)(*args)
            except Exception:  # metrics must never take the engine down
                logger.exception("stat logger %s.%s failed", type(stat_logger).__name__, method)

    @staticmethod
    def _decode_logprob_tokens(tokenizer, output: RequestOutput) -> None:
        """Fill ``Logprob.decoded_token`` (on the thread that may use the tokenizer)."""
        logprobs = output.outputs[0].logprobs
        if not logprobs:
            return
        for entry in logprobs:
            for token_id, logprob in entry.items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = tokenizer.decode([token_id], skip_special_tokens=False)


class AsyncLLM(AsyncEngine):
    """Run ``llm`` on a background thread; serve many concurrent requests from asyncio.

    ``log_stats_interval`` (seconds; None or 0: off) logs vLLM's periodic stats line.
    ``stat_loggers`` receive ``record_finished`` / ``record_aborted`` on the engine thread.
    """

    engine_process = False

    def __init__(self, llm: BaseLLM, *, log_stats_interval: float | None = 10.0,
                 stat_loggers: list[StatLogger] | None = None, idle_poll_s: float = 0.5):
        self.llm = llm
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._stats_log = StatsLogger(log_stats_interval) if log_stats_interval else None
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = (
            queue.SimpleQueue())
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stats = SchedulerStats()
        self._stopping = False
        self._dead: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stagedserve-engine", daemon=True)
        self._thread.start()

    # ---- the public API (any thread / the event loop) ------------------------------------
    @property
    def tokenizer(self):
        """The engine's tokenizer. Call it only through ``call`` (it is the engine thread's)."""
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def model_path(self) -> str:
        return str(self.llm.model_path)

    @property
    def stage(self) -> str:
        return self.llm.stage

    @property
    def engine_args(self) -> dict[str, Any]:
        return dict(self.llm.args)

    @property
    def stats(self) -> SchedulerStats:
        """The engine's stats as of the engine thread's latest loop iteration."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the engine thread, between steps, and return its result."""
        return await asyncio.wrap_future(self._submit(lambda: fn(*args, **kwargs)))

    async def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                          priority: int = 0, cache_salt: str | None = None,
                          received_time: float | None = None) -> RequestStream:
        """Queue a request; return its stream. Invalid input raises ``ValueError`` naming the field.

        ``received_time`` (``time.monotonic``): when the server got the request, for its timeline.
        """
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def add() -> None:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            self.llm.add_request(prompt, params, request_id=request_id, priority=priority, cache_salt=cache_salt)
            timeline = self.llm.output_processor.states[request_id].request.timeline
            timeline.received, timeline.queued = received_time, timeline.arrival  # in the core as it arrives
            self._streams[request_id] = stream

        try:
            await asyncio.wrap_future(self._submit(add))
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still run: do not leave an orphan in the engine
            raise
        return stream

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Returns at once; thread-safe."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self._dead is None and not self._stopping:
            self._commands.put((lambda: self._abort_now(ids, "abort"), None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with ``EngineDeadError``."""
        if self._thread.is_alive():
            self._stopping = True
            self._commands.put((lambda: None, None))  # wake it
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------
    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # so that no command slips in after the engine thread's final drain
            if self._dead is not None or self._stopping:
                future.set_exception(EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})"))
            else:
                self._commands.put((fn, future))
        return future

    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = self.llm.has_unfinished_requests()
                self._run_commands(block=not busy)
                if self._stopping:
                    break
                if self.llm.has_unfinished_requests():
                    self._step()
                self._stats = self.llm.engine.stats()
                if self._stats_log is not None:
                    self._stats_log.maybe_log(self._stats)
            reason: BaseException = EngineDeadError("the server is shutting down")
        except BaseException as exc:  # a bug in this loop: fail loudly, never hang the clients
            logger.exception("engine thread crashed")
            reason = EngineDeadError(f"the engine thread crashed: {exc!r}")
        with self._lock:
            self._dead = reason
        self._end_requests(list(self._streams), lambda rid: reason, "abort")
        while True:  # commands that raced the shutdown
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None and not future.done():
                future.set_exception(reason)

    def _run_commands(self, block: bool, timeout: float | None = None) -> None:
        try:
            item = (self._commands.get(timeout=timeout or self._idle_poll_s) if block
                    else self._commands.get_nowait())
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future is None:  # fire and forget (abort, wake-up): log a failure, keep serving
                try:
                    fn()
                except Exception:
                    logger.exception("engine command failed")
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc if isinstance(exc, Exception) else _as_error(exc))
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except EngineDeadError:  # it cannot step again (a tensor-parallel rank died): stop, /health turns 503
            raise
        except Exception as exc:
            self._fail_step(exc)
            return
        except BaseException as exc:  # not an Exception: a Rust panic in the tokenizer (pyo3's PanicException)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self._fail_step(exc)
            return
        if not outputs and self.llm.engine.stats().num_running == 0:
            # Nothing could be scheduled (no free KV blocks, say): wait for a command instead of spinning.
            self._run_commands(block=True, timeout=0.005)
        deliveries: list[tuple[RequestStream, RequestOutput]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while it ran
            if output.finished:
                del self._streams[output.request_id]
            self._decode_logprob_tokens(self.llm.tokenizer, output)
            deliveries.append((stream, output))
        self._deliver_outputs(deliveries)

    def _fail_step(self, exc: BaseException) -> None:
        # The engine aborted the requests of the failed step; those still waiting were not in it and
        # go on. A failure after the step (nobody aborted, culprit unknown) fails every request.
        unfinished = self.llm.engine.scheduler.requests
        failed = [rid for rid in self._streams if rid not in unfinished] or list(self._streams)
        logger.error("engine step failed; failing %d of %d in-flight request(s)", len(failed), len(self._streams),
                         exc_info=exc)
        self._fail_requests(failed, EngineError(f"the engine failed while running this request ({type(exc).__name__})"))

    def _abort_unread(self, request_ids: list[str]) -> None:
        self._abort_now(request_ids, "abort")  # on the engine thread already: abort now, not via the queue

    def _abort_now(self, request_ids: list[str], reason: str) -> None:
        self._end_requests(request_ids, lambda rid: RequestAborted(f"request {rid} was aborted"), reason)

    def _fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        self._end_requests(request_ids, lambda rid: error, "error")

    def _end_requests(self, request_ids: list[str], make_error: Callable[[str], BaseException], reason: str) -> None:
        """Abort these requests in the engine (their KV is freed) and end their streams with an error."""
        streams = [s for s in (self._streams.pop(rid, None) for rid in request_ids) if s is not None]
        if not streams:
            return
        try:
            self.llm.abort([s.request_id for s in streams])
        except Exception:
            logger.exception("aborting %d request(s) failed", len(streams))
        self._deliver_errors(streams, make_error, reason)

