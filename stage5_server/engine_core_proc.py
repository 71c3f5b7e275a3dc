"""The engine core in a process of its own: a busy loop between two ZeroMQ sockets.

The API-server process (``core_client.MPAsyncLLM``) owns HTTP, tokenization,
detokenization and streaming; this process owns the scheduler, the KV cache manager and
the model, and never sees text. They speak msgpack over two one-way sockets:

    input  (PULL) <- ["add", request] | ["abort", [request ids]] | ["shutdown", None]
    loop:  take every queued message (block while idle) -> engine.step() -> send what changed
    output (PUSH) -> {"outputs": [new token ids + times + finish info, per request], "stats": ..., "failed": ...}

A request crosses the boundary as token ids with its request id, sampling parameters and
arrival time; an output carries only the tokens the front end has not seen yet, their
timestamps (``time.monotonic``: one clock for every process of the machine) and the finish
reason. Start-up is a handshake: the first message is ``ready`` (with the resolved
configuration) or ``startup_error`` (the child's exception, surfaced by the parent).

The process exits on ``shutdown``, on SIGTERM, or when its parent is gone (an orphan would
otherwise hold the model's memory forever); SIGINT is ignored, because a Ctrl-C in a
terminal reaches the whole process group and the parent decides how to shut down.

vLLM: ``vllm/v1/engine/core.py`` (``EngineCoreProc.run_busy_loop``; vLLM also moves socket
reads and writes, with their serialization, onto two threads so they overlap a GPU step),
``vllm/v1/engine/__init__.py`` (``EngineCoreRequest``, ``EngineCoreOutput(s)``) and
``vllm/v1/serial_utils.py`` (``MsgpackEncoder`` / ``MsgpackDecoder``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import traceback
from typing import Any

import msgpack
import zmq

from shared.metrics import SchedulerStats
from shared.outputs import Logprob
from shared.request import Request, RequestStatus
from shared.sampling_params import SamplingParams
from stage5_server.async_llm import EngineDeadError

logger = logging.getLogger("stagedserve")

IDLE_POLL_MS = 200  # while idle, wake this often to check that the parent is still alive
SEND_TIMEOUT_MS = 5000  # a send blocks only when no API server is connected: then give up
NOTHING_SCHEDULABLE_POLL_MS = 5  # nothing could run (KV full): wait this long for an abort or a new request


# ---- the wire format (both processes) --------------------------------------------------------


def encode(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def request_to_wire(request: Request) -> dict[str, Any]:
    """What the core needs of a request: token ids, never text (``EngineCoreRequest``)."""
    return {"id": request.request_id, "prompt": request.prompt_token_ids,
            "params": dataclasses.asdict(request.sampling_params), "arrival": request.arrival_time,
            "priority": request.priority, "salt": request.cache_salt, "eos": list(request.eos_token_ids)}


def request_from_wire(wire: dict[str, Any]) -> Request:
    return Request(wire["id"], wire["prompt"], SamplingParams(**wire["params"]), arrival_time=wire["arrival"],
                   priority=wire["priority"], cache_salt=wire["salt"], eos_token_ids=tuple(wire["eos"]))


def output_to_wire(request: Request, num_sent: int) -> dict[str, Any]:
    """The tokens after ``num_sent``, their timestamps, and how the request stands (``EngineCoreOutput``)."""
    timeline = request.timeline
    logprobs = None
    if request.sampling_params.logprobs is not None:
        logprobs = [[[token_id, lp.logprob, lp.rank] for token_id, lp in entry.items()]
                    for entry in request.logprobs[num_sent:]]
    return {"id": request.request_id, "tokens": request.output_token_ids[num_sent:],
            "times": timeline.token_times[num_sent:], "logprobs": logprobs,
            "finish": request.status.finish_reason, "stop_reason": request.stop_reason,
            "cached": request.num_cached_tokens, "queued": timeline.queued,
            "scheduled": timeline.first_scheduled, "finished": timeline.finished}


def logprobs_from_wire(entries: list[list[list]]) -> list[dict[int, Logprob]]:
    return [{token_id: Logprob(logprob, rank) for token_id, logprob, rank in entry} for entry in entries]


FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH_CAPPED,
                 "abort": RequestStatus.FINISHED_ABORTED}


# ---- the process -------------------------------------------------------------------------------


class EngineCoreProc:
    """The busy loop over an already-built engine core and two connected sockets."""

    def __init__(self, engine, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int):
        self.engine = engine
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.num_sent: dict[str, int] = {}  # request id -> output tokens already sent
        self.stopping = False
        self.dead = False  # the engine cannot step again (e.g. a tensor-parallel rank died)
        self._last_stats: SchedulerStats | None = None

    def run(self) -> None:
        while not self.stopping:
            busy = self.engine.has_unfinished_requests()
            self.take_messages(0 if busy else IDLE_POLL_MS)
            if self.stopping or os.getppid() != self.parent_pid:
                break  # asked to stop, or orphaned (the parent was killed)
            if self.engine.has_unfinished_requests():
                self.step()
            elif self.engine.stats() != self._last_stats:
                self.send([])  # an abort changed the counts: keep the front end's /metrics current

    def take_messages(self, timeout_ms: int) -> None:
        """Handle every message already queued, waiting up to ``timeout_ms`` for the first."""
        if not self.input.poll(timeout_ms):
            return
        while not self.stopping:
            try:
                kind, payload = decode(self.input.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if kind == "add":
                request = request_from_wire(payload)
                request.timeline.queued = time.monotonic()
                self.engine.add_request(request)
                self.num_sent[request.request_id] = 0
            elif kind == "abort":
                ids = [rid for rid in payload if self.num_sent.pop(rid, None) is not None]
                self.engine.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            elif kind == "shutdown":
                self.stopping = True

    def step(self) -> None:
        try:
            updated = self.engine.step()
        except Exception as exc:  # fail what is in flight, keep serving (the in-process loop does the same)
            logger.exception("engine step failed; aborting %d in-flight request(s)", len(self.num_sent))
            ids = list(self.num_sent)
            self.engine.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.num_sent.clear()
            error = str(exc) if isinstance(exc, EngineDeadError) else \
                f"the engine failed while running this request ({type(exc).__name__})"
            self.send([], failed={"ids": ids, "error": error})
            if isinstance(exc, EngineDeadError):  # it cannot step again: exit, the API server turns unhealthy
                self.dead = True
                self.stopping = True
            return
        outputs = []
        for request in updated:
            num_sent = self.num_sent.get(request.request_id)
            if num_sent is None:
                continue  # aborted meanwhile
            outputs.append(output_to_wire(request, num_sent))
            if request.is_finished:
                del self.num_sent[request.request_id]
            else:
                self.num_sent[request.request_id] = request.num_output_tokens
        if outputs or self.engine.stats() != self._last_stats:
            self.send(outputs)
        if not updated and self.engine.stats().num_running == 0:
            self.take_messages(NOTHING_SCHEDULABLE_POLL_MS)  # do not spin while nothing fits

    def send(self, outputs: list[dict[str, Any]], failed: dict[str, Any] | None = None) -> None:
        self._last_stats = self.engine.stats()
        try:
            self.output.send(encode({"type": "outputs", "outputs": outputs, "failed": failed,
                                     "stats": dataclasses.asdict(self._last_stats)}))
        except zmq.Again:  # nobody at the other end any more
            logger.error("the API server stopped reading outputs; exiting")
            self.stopping = True


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # unwinds the loop: the sockets close, the parent sees the process end


def run_engine_core(model_path: str, engine_args: dict[str, Any], input_address: str, output_address: str,
                    parent_pid: int, log_level: int = logging.INFO) -> None:
    """The child's entry point (``multiprocessing`` spawn): build the engine, shake hands, loop.

    ``engine_args`` go to stage5's ``LLM(...)`` untouched, so every engine argument the
    in-process server accepts works here too.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(format="%(levelname)s %(asctime)s [engine-core pid %(process)d] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    logger.setLevel(log_level)
    context = zmq.Context()
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow reader, only on a missing one
    output_socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    output_socket.connect(output_address)
    input_socket = context.socket(zmq.PULL)
    input_socket.setsockopt(zmq.LINGER, 0)
    input_socket.connect(input_address)
    try:
        try:
            from stage5_server.llm import LLM

            llm = LLM(model=model_path, **engine_args)
        except BaseException as exc:
            output_socket.send(encode({"type": "startup_error", "error_type": type(exc).__name__,
                                       "message": str(exc), "traceback": traceback.format_exc()}))
            return
        config = {"pid": os.getpid(), "model_path": str(llm.model_path), "stage": llm.stage,
                  "max_model_len": llm.max_model_len, "vocab_size": llm.model_config.vocab_size,
                  "eos_token_ids": list(llm.model_config.eos_token_ids),
                  "tokenizer": str(llm.args["tokenizer"] or llm.model_path),
                  "engine_args": {k: _plain(v) for k, v in llm.args.items()}}
        output_socket.send(encode({"type": "ready", "config": config}))
        proc = EngineCoreProc(llm.engine, input_socket, output_socket, parent_pid)
        proc.run()
        logger.info("engine core process exiting")
        if proc.dead:
            raise SystemExit(1)
    except zmq.Again:
        logger.error("no API server to report to; exiting")
    finally:
        input_socket.close()
        output_socket.close()
        context.term()
