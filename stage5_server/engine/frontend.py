"""``AsyncEngine``: the front end of an async engine, whether its core runs on a thread
(``AsyncLLM``) or in a process of its own (``MPAsyncLLM``).

    add_request: InputProcessor (render, tokenize, check, fan out n) --AddRequest--> core
    core --EngineCoreOutputs--> _on_outputs: OutputProcessor (detokenize, stop strings: those requests
        are aborted in the core) -> each RequestOutput to its request's stream

The input and output processors are the offline ``LLM``'s too (``engine/input_processor.py``,
``engine/output_processor.py``): one front end, whichever client carries its messages to the core.

The tokenizer and the request table are used under one lock: a worker thread (rendering and tokenizing,
off the event loop) and the output thread (detokenizing) take turns. A failure on one request's output fails it alone.

vLLM: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``abort``, ``output_handler``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from shared.llm_base import PromptType
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from stage5_server.core.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityCall,
)
from stage5_server.core.stats import LoggingStatLogger, SchedulerStats
from stage5_server.engine.input_processor import InputProcessor
from stage5_server.engine.output_processor import OutputProcessor, RequestOutputKind
from stage5_server.engine.stream import RequestStream
from stage5_server.engine.utility_client import UtilityClient
from stage5_server.errors import EngineDeadError, EngineError, RequestAborted
from stage5_server.lora.request import LoRARequest
from stage5_server.multimodal.processor import ImageProcessor

if TYPE_CHECKING:
    from stage5_server.weight_sync.client import WeightSyncClient

logger = logging.getLogger("stagedserve")

T = TypeVar("T")


class StatLoggerBase(Protocol):
    """What an ``AsyncEngine`` tells a stat logger, on the thread that receives outputs."""

    def record_finished(self, output: RequestOutput, params: SamplingParams) -> None: ...
    def record_aborted(self, reason: str) -> None: ...


def is_fatal(exc: BaseException) -> bool:
    """Only these end the process; any other BaseException (a Rust panic in the tokenizer) fails one request."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit))


def _guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, a non-``Exception`` failure (a Rust panic) turned into an ``EngineError``."""
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        if isinstance(exc, Exception) or is_fatal(exc):
            raise
        logger.error("%s failed", getattr(fn, "__name__", "an engine call"), exc_info=exc)
        raise EngineError(f"the engine failed on this request ({type(exc).__name__})") from None


def prompt_text(prompt: PromptType) -> str | None:
    """The prompt's text, if it came as text (a string, or ``{"prompt": text, ...}``)."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def dead_core_stats(stats: SchedulerStats) -> SchedulerStats:
    """A dead core runs and holds nothing; its counters keep what it did."""
    return dataclasses.replace(stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)


class AsyncEngine:
    """What the server uses of an engine. A client subclass sends the messages (``_send``, ``_send_utility``),
    delivers the core's outputs to ``_on_outputs`` and its utility answers to ``utilities.on_output``, and
    reports its death (``_engine_died``). ``stat_loggers`` run on the output thread; ``cache_configs``: each
    core's KV-cache config, by rank. ``weight_sync``: weight updates and sleep (``weight_sync/client.py``), a
    member only when the engine runs with them."""

    engine_process: ClassVar[bool]  # True: the core runs in a process of its own
    # Which of the API servers that share the engine cores this front end is (``--api-server-count``).
    client_index: int = 0
    client_count: int = 1

    def __init__(self, *, tokenizer: Tokenizer, model_path: str, stage: str, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], engine_args: dict[str, Any],
                 log_stats_interval: float | None = 10.0, stat_loggers: list[StatLoggerBase] | None = None,
                 cache_configs: dict[int, dict[str, str]] | None = None):
        self.tokenizer = tokenizer  # use it only through ``call``
        self.model_path = model_path
        self.stage = stage
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.engine_args = engine_args  # the resolved engine configuration
        self.cache_configs = dict(cache_configs or {})
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers or [])
        self.image_processor = ImageProcessor.for_model(model_path)  # None: the model takes no images
        self.input_processor = InputProcessor(tokenizer, vocab_size, max_model_len, eos_token_ids,
                                              self.image_processor, bool(engine_args.get("enable_lora")))
        # The requests in flight; an output that cannot be made fails its request alone.
        self.output_processor = OutputProcessor(tokenizer, decode_logprobs=True, contain_failures=True)
        self._stats_log = LoggingStatLogger(log_stats_interval) if log_stats_interval else None
        self._stats = SchedulerStats()
        self._lock = threading.Lock()  # the tokenizer and both processors
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self.utilities = UtilityClient(self._send_utility)  # calls the core runs between steps
        self.weight_sync: WeightSyncClient | None = None
        if engine_args.get("enable_weight_sync"):
            from stage5_server.weight_sync.client import WeightSyncClient

            self.weight_sync = WeightSyncClient(self.utilities, lambda: self.stats)

    # ---- what a client provides -----------------------------------------------------------------
    def _send(self, message: EngineCoreInput) -> None:
        """Hand a message to the core without blocking; raise ``EngineDeadError`` if none takes it."""
        raise NotImplementedError

    def _send_utility(self, call: UtilityCall) -> int:
        """Send a utility call to the core(s) without blocking; the number of answers to wait for."""
        raise NotImplementedError

    def _core_alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    # ---- the public API (the event loop, or any thread) -------------------------------------------
    @property
    def stats(self) -> SchedulerStats:
        """The core's stats as of its latest published step."""
        return self._stats if self._dead is None else dead_core_stats(self._stats)

    @property
    def stats_by_engine(self) -> dict[int, SchedulerStats]:
        """Each engine core's stats, by data-parallel rank (here the one core, rank 0)."""
        return {0: self.stats}

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._core_alive()

    async def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                             timeout: float | None = None) -> list:
        """``method`` on every worker of every engine core, between steps; the results in (core, rank) order."""
        answers = await self.utilities.call("collective_rpc", method, tuple(args), kwargs, timeout=timeout)
        return [result for per_core in answers for result in per_core]

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block of every core; False while requests hold blocks."""
        return all(await self.utilities.call("reset_prefix_cache"))

    @property
    def weight_version(self) -> int:
        """The weight version a request sent now runs on (0 unless weight sync is on)."""
        return 0 if self.weight_sync is None else self.weight_sync.weight_version

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (tokenization) on a worker thread, never during detokenization: work that grows
        with a request's size never holds up the event loop (vLLM tokenizes off the loop too)."""
        self._check_running()
        return await asyncio.to_thread(self._locked, fn, *args, **kwargs)

    def _locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return _guarded(fn, *args, **kwargs)

    async def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                          priority: int = 0, cache_salt: str | None = None, received_time: float | None = None,
                          output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Check the request (a ``ValueError`` names the field; ``InputProcessor`` takes every prompt form)
        and send it, or its ``n`` children, to the core; return its stream. ``received_time``
        (``time.monotonic``): when the server got it, for its timeline."""
        request_id = request_id or uuid.uuid4().hex
        self._check_running()
        loop = asyncio.get_running_loop()
        # Rendering and tokenizing run on a worker thread, so the loop serves everyone else meanwhile.
        added = loop.run_in_executor(None, functools.partial(
            self._add_request, loop, prompt, params, request_id, priority=priority, cache_salt=cache_salt,
            received_time=received_time, output_kind=output_kind, lora_request=lora_request))
        try:
            return await asyncio.shield(added)
        except asyncio.CancelledError:  # nobody will read it: abort it once it is in
            added.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result().request_id))
            raise

    def _add_request(self, loop: asyncio.AbstractEventLoop, prompt: PromptType, params: SamplingParams,
                     request_id: str, *, priority: int, cache_salt: str | None, received_time: float | None,
                     output_kind: RequestOutputKind, lora_request: LoRARequest | None) -> RequestStream:
        with self._lock:
            parent, requests = _guarded(self.input_processor.process_inputs, request_id, prompt, params,
                                        priority=priority, cache_salt=cache_salt, lora_request=lora_request)
            if any(map(self.output_processor.has_request, {request_id, *(r.request_id for r in requests)})):
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            stream = RequestStream(request_id, loop, output_kind is RequestOutputKind.DELTA)
            for index, r in enumerate(requests):
                self.output_processor.add_request(r.request_id, prompt_text(prompt),
                                                  r.prompt_token_ids, r.sampling_params, r.arrival_time,
                                                  kind=output_kind, parent=parent, index=index, queue=stream,
                                                  received=received_time)
        self._send_requests(requests, request_id)
        return stream

    def is_in_flight(self, request_id: str) -> bool:
        """Whether ``request_id`` (a request or a parallel-sampling parent) still has outputs to come."""
        with self._lock:
            return self.output_processor.has_request(request_id)

    @property
    def is_pooling(self) -> bool:
        """The core runs the pooling runner: it returns vectors (``pooling/``), never tokens."""
        return self.engine_args.get("runner") == "pooling"

    async def add_pooling_request(self, token_ids: list[int], request_id: str, *, cache_salt: str | None = None,
                                  received_time: float | None = None) -> RequestStream:
        """Send checked token ids (``pooling/offline.py``'s ``pooling_token_ids``) to a pooling core; the stream's
        one output is final, its vector in ``RequestOutput.pooled``."""
        self._check_running()
        return await asyncio.to_thread(self._add_pooling_request, asyncio.get_running_loop(), token_ids, request_id,
                                       cache_salt, received_time)

    def _add_pooling_request(self, loop: asyncio.AbstractEventLoop, token_ids: list[int], request_id: str,
                             cache_salt: str | None, received_time: float | None) -> RequestStream:
        request = self.input_processor.pooling_request(request_id, token_ids, cache_salt)
        with self._lock:
            if self.output_processor.has_request(request_id):
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            stream = RequestStream(request_id, loop, False)
            self.output_processor.add_request(request_id, None, token_ids, request.sampling_params,
                                              request.arrival_time, kind=RequestOutputKind.FINAL_ONLY, queue=stream,
                                              received=received_time)
        self._send_requests([request], request_id)
        return stream

    def _send_requests(self, requests: list[EngineCoreRequest], request_id: str) -> None:
        """Send ``requests`` (one prompt's) to the core; if the core is dead, forget them here and raise."""
        try:
            for request in requests:
                self._send(AddRequest(request))
        except EngineDeadError:
            with self._lock:
                self.output_processor.abort_requests([request_id])
            raise

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Returns at once; thread-safe."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            streams = self.output_processor.queues_of(ids)
            engine_ids = self.output_processor.abort_requests(ids)
        if streams:
            self._send_quietly(AbortRequests(engine_ids))
            self._deliver_errors(streams, lambda rid: RequestAborted(f"request {rid} was aborted"), "abort")

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, *,
                       priority: int = 0, cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative ``RequestOutput``s until the final one; closing the generator early aborts."""
        stream = await self.add_request(prompt, params, request_id, priority=priority, cache_salt=cache_salt,
                                        lora_request=lora_request)
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
        with self._lock:
            processed = self.output_processor.process_outputs(message.outputs)
        if processed.reqs_to_abort:
            self._send_quietly(AbortRequests(processed.reqs_to_abort))
        for request_id, exc in processed.failed:
            logger.error("processing an output of request %s failed", request_id, exc_info=exc)
            self._fail([request_id], EngineError(f"the engine failed while running this request "
                                                 f"({type(exc).__name__})"), "error")
            self._send_quietly(AbortRequests([request_id]))
        self._deliver_outputs(processed.deliveries, processed.finished)
        self.log_stats_if_due()

    def _update_stats(self, message: EngineCoreOutputs) -> None:
        self._stats = message.scheduler_stats

    def log_stats_if_due(self) -> None:
        if self._stats_log is not None:
            self._stats_log.maybe_log(self.stats)

    def _engine_died(self, why: str) -> None:
        logger.error("%s; failing %d in-flight request(s)", why, len(self.output_processor))
        self._dead = EngineDeadError(why)
        self.utilities.senders_gone(why)
        self._fail_all(EngineError(f"{why} while running this request"), "error")

    # ---- helpers --------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")
        if self.weight_sync is not None:
            self.weight_sync.check_awake()  # asleep: refused (503), never left waiting

    def _send_quietly(self, message: EngineCoreInput) -> None:
        try:
            self._send(message)
        except EngineDeadError:
            pass  # an abort for a core that is gone: nothing left to abort

    def _fail(self, request_ids: list[str], error: BaseException, reason: str) -> None:
        """Fail requests (and their ``n > 1`` siblings: those are aborted in the core)."""
        with self._lock:
            streams = self.output_processor.queues_of(request_ids)
            engine_ids = self.output_processor.abort_requests(request_ids)
        siblings = [rid for rid in engine_ids if rid not in request_ids]
        if siblings:
            self._send_quietly(AbortRequests(siblings))
        self._deliver_errors(streams, lambda rid: error, reason)

    def _fail_all(self, error: BaseException, reason: str) -> None:
        with self._lock:
            ids = list(self.output_processor.engine_ids)
        self._fail(ids, error, reason)

    def _deliver_outputs(self, items: list[tuple[RequestStream, RequestOutput]],
                         finished: list[tuple[RequestOutput, SamplingParams]]) -> None:
        """Hand outputs to their streams' loops; stamp each request's first delivery; tell the stat loggers of
        each engine request that finished (``finished``: their whole outputs, handed over by now: an ``n > 1``
        child's may travel inside its parent's output, under another timeline)."""
        now = time.monotonic()
        for output in [o for _, o in items] + [o for o, _ in finished]:
            if output.timeline.first_delivered is None:
                output.timeline.first_delivered = now
        for output, params in finished:
            self._record("record_finished", output, params)
        self._deliver(items)

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
