"""``AsyncEngine``: the front end of an async engine, whether its core runs on a thread
(``AsyncLLM``) or in a process of its own (``MPAsyncLLM``).

    add_request: check the prompt, tokenize, keep a copy of the Request --AddRequest--> core
    core --EngineCoreOutputs--> _on_outputs: update the copies, detokenize, find stop strings
        (and abort those requests in the core), hand each RequestOutput to its request's stream

The tokenizer and the request table are used under one lock: the event loop (tokenizing) and the
output thread (detokenizing) take turns. A failure on one request's output fails it alone.

vLLM: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``abort``, ``output_handler``)
and ``vllm/v1/engine/output_processor.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, Protocol, TypeVar

from shared.llm_base import PromptType, check_token_ids, prompt_token_ids
from shared.metrics import SchedulerStats
from shared.output_processor import OutputProcessor
from shared.outputs import RequestOutput
from shared.request import Request, RequestStatus
from shared.sampling_params import SamplingParams, tokenize_bad_words
from shared.structured_output import check_structured_outputs
from shared.tokenizer import Tokenizer
from stage4_prefix_cache import StatsLogger
from stage5_server.engine.errors import EngineDeadError, EngineError, RequestAborted
from stage5_server.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from stage5_server.engine.stream import RequestStream

logger = logging.getLogger("stagedserve")

T = TypeVar("T")


class StatLogger(Protocol):
    """What an ``AsyncEngine`` tells a stat logger, on the thread that receives outputs."""

    def record_finished(self, output: RequestOutput, params: SamplingParams) -> None: ...
    def record_aborted(self, reason: str) -> None: ...


def is_fatal(exc: BaseException) -> bool:
    """Only these end the process; any other BaseException (a Rust panic in the tokenizer) fails one request."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit))


class AsyncEngine:
    """What the server uses of an engine. A client subclass sends the messages (``_send``), delivers the
    core's outputs to ``_on_outputs`` and reports its death (``_engine_died``). ``stat_loggers`` run on
    the output thread; ``cache_configs``: each core's KV-cache config, by rank."""

    engine_process: ClassVar[bool]  # True: the core runs in a process of its own

    def __init__(self, *, tokenizer: Tokenizer, model_path: str, stage: str, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], engine_args: dict[str, Any],
                 log_stats_interval: float | None = 10.0, stat_loggers: list[StatLogger] | None = None,
                 cache_configs: dict[int, dict[str, str]] | None = None):
        self.tokenizer = tokenizer  # use it only through ``call``
        self.model_path = model_path
        self.stage = stage
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.engine_args = engine_args  # the resolved engine configuration
        self.cache_configs = dict(cache_configs or {})
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.output_processor = OutputProcessor(tokenizer)
        self._stats_log = StatsLogger(log_stats_interval) if log_stats_interval else None
        self._stats = SchedulerStats()
        self._lock = threading.Lock()  # the tokenizer, the output processor and the table below
        self._requests: dict[str, tuple[Request, RequestStream]] = {}
        self._dead: EngineDeadError | None = None
        self._stopping = False

    # ---- what a client provides -----------------------------------------------------------------
    def _send(self, message: EngineCoreInput) -> None:
        """Hand a message to the core without blocking; raise ``EngineDeadError`` if none takes it."""
        raise NotImplementedError

    def _core_alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    # ---- the public API (the event loop, or any thread) -------------------------------------------
    @property
    def stats(self) -> SchedulerStats:
        """The core's stats as of its latest published step."""
        return self._stats

    @property
    def stats_by_engine(self) -> dict[int, SchedulerStats]:
        """Each engine core's stats, by data-parallel rank (here the one core, rank 0)."""
        return {0: self._stats}

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._core_alive()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (tokenization) on the caller's thread, never during detokenization."""
        self._check_running()
        with self._lock:
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, Exception) or is_fatal(exc):
                    raise
                logger.error("%s failed", getattr(fn, "__name__", "an engine call"), exc_info=exc)
                raise EngineError(f"the engine failed on this request ({type(exc).__name__})") from None

    async def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                          priority: int = 0, cache_salt: str | None = None,
                          received_time: float | None = None) -> RequestStream:
        """Check the request (a ``ValueError`` names the field) and send it to the core; return its stream.
        ``received_time`` (``time.monotonic``): when the server got it, for its timeline."""
        request_id = request_id or uuid.uuid4().hex
        self._check_running()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if params.n > 1:
            raise ValueError("n: this engine runs one sample per request; send n requests (seeds seed + i)")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size, self.max_model_len)
            bad_words = tokenize_bad_words(params.bad_words, lambda text: self.tokenizer.encode(text, False))
            check_token_ids(params, bad_words, self.vocab_size)  # ids outside the vocabulary would fail a step
            if params.structured_outputs is not None:
                check_structured_outputs(params.structured_outputs)  # a spec the grammar engine refuses: a 400
            request = Request(request_id, token_ids, params, priority=priority, cache_salt=cache_salt,
                              eos_token_ids=self.eos_token_ids, bad_words_token_ids=bad_words)
            request.timeline.received = received_time
            stream = RequestStream(request_id, asyncio.get_running_loop())
            self._requests[request_id] = (request, stream)
            self.output_processor.add_request(request, prompt if isinstance(prompt, str) else None)
        try:
            self._send(AddRequest(EngineCoreRequest.from_request(request)))
        except EngineDeadError:
            with self._lock:
                self._forget(request_id)
            raise
        return stream

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Returns at once; thread-safe."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            streams = [stream for stream in (self._forget(rid) for rid in ids) if stream is not None]
        if streams:
            self._send_quietly(AbortRequests([s.request_id for s in streams]))
            self._deliver_errors(streams, lambda rid: RequestAborted(f"request {rid} was aborted"), "abort")

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative ``RequestOutput``s until the final one; closing the generator early aborts."""
        stream = await self.add_request(prompt, params, request_id, priority=priority, cache_salt=cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    # ---- outputs from the core (the thread that receives them) ---------------------------------
    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        if message.failed is not None:
            failed = message.failed
            self._fail(failed.request_ids, (EngineDeadError if failed.engine_dead else EngineError)(failed.error),
                       "error")
        self._update_stats(message)
        deliveries: list[tuple[RequestStream, RequestOutput, SamplingParams]] = []
        stopped: list[str] = []
        broken: list[tuple[str, BaseException]] = []
        with self._lock:
            for core_output in message.outputs:
                entry = self._requests.get(core_output.request_id)
                if entry is None:
                    continue  # aborted, or ended by a stop string, while the core was stepping
                request, stream = entry
                try:
                    output = self._build_output(request, core_output, stopped)
                except BaseException as exc:  # a Rust panic while detokenizing, say: fail this request only
                    if is_fatal(exc):
                        raise
                    broken.append((request.request_id, exc))
                    continue
                if output.finished:
                    self._forget(request.request_id)
                deliveries.append((stream, output, request.sampling_params))
        if stopped:
            self._send_quietly(AbortRequests(stopped))
        for request_id, exc in broken:
            logger.error("processing an output of request %s failed", request_id, exc_info=exc)
            self._fail([request_id], EngineError(f"the engine failed while running this request "
                                                 f"({type(exc).__name__})"), "error")
            self._send_quietly(AbortRequests([request_id]))
        self._deliver_outputs(deliveries)
        self.log_stats_if_due()

    def _build_output(self, request: Request, core_output: EngineCoreOutput, stopped: list[str]) -> RequestOutput:
        core_output.apply_to(request)
        if self.output_processor.update(request):  # a stop string ended it: tell the core
            request.status = RequestStatus.FINISHED_STOPPED
            request.timeline.finished = request.timeline.token_times[-1]
            stopped.append(request.request_id)
        output = self.output_processor.make_output(request.request_id)
        self._decode_logprob_tokens(output)
        return output

    def _update_stats(self, message: EngineCoreOutputs) -> None:
        self._stats = message.scheduler_stats

    def log_stats_if_due(self) -> None:
        if self._stats_log is not None:
            self._stats_log.maybe_log(self.stats)

    def _engine_died(self, why: str) -> None:
        logger.error("%s; failing %d in-flight request(s)", why, len(self._requests))
        self._dead = EngineDeadError(why)
        self._fail_all(EngineError(f"{why} while running this request"), "error")

    # ---- helpers --------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")

    def _send_quietly(self, message: EngineCoreInput) -> None:
        try:
            self._send(message)
        except EngineDeadError:
            pass  # an abort for a core that is gone: nothing left to abort

    def _forget(self, request_id: str) -> RequestStream | None:
        """Drop a request from the table (caller holds ``_lock``); return its stream."""
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

    def _decode_logprob_tokens(self, output: RequestOutput) -> None:
        """Fill ``Logprob.decoded_token`` (the caller holds the tokenizer's lock)."""
        for entry in [*(output.outputs[0].logprobs or ()), *(output.prompt_logprobs or ())]:
            for token_id, logprob in (entry or {}).items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _deliver_outputs(self, items: list[tuple[RequestStream, RequestOutput, SamplingParams]]) -> None:
        """Hand outputs to their streams' loops; stamp each request's first delivery."""
        now = time.monotonic()
        for _, output, params in items:
            if output.timeline.first_delivered is None:
                output.timeline.first_delivered = now
            if output.finished:
                self._record("record_finished", output, params)
        self._deliver([(stream, output) for stream, output, _ in items])

    def _deliver_errors(self, streams: list[RequestStream], make_error: Callable[[str], BaseException],
                        reason: str) -> None:
        for _ in streams:
            self._record("record_aborted", reason)
        self._deliver([(stream, make_error(stream.request_id)) for stream in streams])

    def _deliver(self, items: list[tuple[RequestStream, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = defaultdict(list)
        for stream, item in items:
            by_loop[stream.loop].append((stream, item))
        for loop, loop_items in by_loop.items():
            def put_all(loop_items=loop_items) -> None:
                for stream, item in loop_items:
                    stream.put(item)

            try:
                loop.call_soon_threadsafe(put_all)
            except RuntimeError:  # that event loop is closed: nobody will read these
                self.abort([stream.request_id for stream, _ in loop_items])

    def _record(self, method: str, *args: Any) -> None:
        for stat_logger in tuple(self.stat_loggers):  # the app may add or remove one meanwhile
            try:
                getattr(stat_logger, method)(*args)
            except Exception:  # metrics must never take the engine down
                logger.exception("stat logger %s.%s failed", type(stat_logger).__name__, method)
