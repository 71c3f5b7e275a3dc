"""The engine core in a process of its own: the core loop between two ZeroMQ sockets.

The API-server process (``process_client.MPAsyncLLM``) owns HTTP, tokenization,
detokenization and streaming; this process owns the scheduler, the KV cache manager and
the model, and never sees text. They speak the Structs of ``messages.py``, as msgpack:

    input  (PULL) <- AddRequest | AbortRequests | Shutdown
    output (PUSH) -> EngineCoreReady or EngineCoreStartupError first, then EngineCoreOutputs per step

The loop is ``core_loop.EngineCoreLoop``, the same one the thread mode runs. The process
exits on ``Shutdown``, on SIGTERM, or when its parent is gone (an orphan would otherwise
hold the model's memory forever); SIGINT is ignored, because a Ctrl-C in a terminal
reaches the whole process group and the parent decides how to shut down.

vLLM: ``EngineCoreProc`` in ``vllm/v1/engine/core.py`` (vLLM also moves socket reads and
writes, with their serialization, onto two threads so they overlap a GPU step).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import Any

import zmq

from shared.llm_base import EngineCore
from shared.structured_output import StructuredOutputManager
from stage5_server.engine.core_loop import EngineCoreLoop
from stage5_server.engine.messages import (
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreStartupError,
    encoder,
    input_decoder,
    plain,
)

logger = logging.getLogger("stagedserve")

SEND_TIMEOUT_MS = 5000  # a send blocks only when no API server is connected: then give up


class ZmqCoreLoop(EngineCoreLoop):
    """The core loop over two connected sockets, watching that its parent is still there."""

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int,
                 grammars: StructuredOutputManager | None = None):
        super().__init__(core, grammars=grammars)
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid

    def receive(self, timeout_s: float) -> list[EngineCoreInput]:
        messages = []
        if self.input.poll(int(timeout_s * 1000)):
            while True:
                try:
                    messages.append(input_decoder.decode(self.input.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return messages

    def publish(self, outputs: EngineCoreOutputs) -> None:
        try:
            self.output.send(encoder.encode(outputs))
        except zmq.Again:  # nobody at the other end any more
            logger.error("the API server stopped reading outputs; exiting")
            self.stopping = True

    def keep_running(self) -> bool:
        return os.getppid() == self.parent_pid  # else orphaned: the parent was killed


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
            output_socket.send(encoder.encode(EngineCoreStartupError(type(exc).__name__, str(exc),
                                                                     traceback.format_exc())))
            return
        output_socket.send(encoder.encode(EngineCoreReady(
            pid=os.getpid(), model_path=str(llm.model_path), stage=llm.stage, max_model_len=llm.max_model_len,
            vocab_size=llm.model_config.vocab_size, eos_token_ids=list(llm.model_config.eos_token_ids),
            tokenizer=str(llm.args["tokenizer"] or llm.model_path),
            engine_args={k: plain(v) for k, v in llm.args.items()})))
        loop = ZmqCoreLoop(llm.engine, input_socket, output_socket, parent_pid, llm.structured_output_manager)
        loop.run()
        logger.info("engine core process exiting")
        if loop.dead:
            raise SystemExit(1)
    except zmq.Again:
        logger.error("no API server to report to; exiting")
    finally:
        input_socket.close()
        output_socket.close()
        context.term()
