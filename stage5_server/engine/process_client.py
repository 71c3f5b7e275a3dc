"""``MPAsyncLLM``: the front end in this process, the engine core in a child process.

    event loop (HTTP, tokenization) --AddRequest/AbortRequests--> [input socket] --> core process
    output thread <-- [output socket] <-- EngineCoreOutputs per step
    output thread: the front end's _on_outputs (detokenize, stop strings, streams)

The child (``core_proc.py``) steps while this process parses HTTP and detokenizes: no turns
under one GIL. When the child dies, every request in flight fails with ``EngineError`` (a 500)
and ``/health`` answers 503; ``shutdown`` (or a finalizer at exit) stops the child.

vLLM: ``vllm/v1/engine/core_client.py`` (``MPClient``, ``AsyncMPClient``),
``vllm/v1/engine/async_llm.py`` (``output_handler``) and ``vllm/v1/engine/utils.py``
(``CoreEngineProcManager``, ``wait_for_engine_startup``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any

import zmq

from shared.named_models import default_model, resolve_model
from shared.tokenizer import Tokenizer
from stage5_server.engine.core_proc import run_engine_core
from stage5_server.engine.errors import EngineDeadError
from stage5_server.engine.frontend import AsyncEngine, StatLogger
from stage5_server.engine.messages import (
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreStartupError,
    Shutdown,
    encoder,
    open_socket,
    output_decoder,
)
from stage5_server.engine.processes import stop_process

logger = logging.getLogger("stagedserve")

DEFAULT_STARTUP_TIMEOUT_S = 600.0
OUTPUT_POLL_MS = 100


class MPAsyncLLM(AsyncEngine):
    """The engine core in a child process, driven over ZeroMQ. Start-up raises ``ValueError`` for a bad
    engine argument, ``RuntimeError`` when the child fails, ``TimeoutError`` after ``startup_timeout_s``."""

    engine_process = True

    def __init__(self, model: str | None = None, *, log_stats_interval: float | None = 10.0,
                 stat_loggers: list[StatLogger] | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, **engine_args: Any):
        # Resolved (a name or .gguf to its directory) once here, so both processes agree.
        model_path = resolve_model(model) if model else default_model()
        self._input_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe
        self._ipc_dir = tempfile.mkdtemp(prefix="stagedserve-")
        input_address, output_address = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self._context = zmq.Context()
        # SNDHWM=0, no limit: a send only fails when no engine is connected
        self._input = open_socket(self._context, zmq.PUSH, bind=input_address, LINGER=0, SNDHWM=0)
        self._output = open_socket(self._context, zmq.PULL, bind=output_address, LINGER=0)
        # spawn, never fork: a forked child would inherit this process's threads and torch state.
        # Not a daemon: the engine may start processes of its own (tensor parallel workers).
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="stagedserve-engine-core",
            args=(model_path, dict(engine_args), input_address, output_address, os.getpid(),
                  logger.getEffectiveLevel()))
        self._process.start()
        self._finalizer = weakref.finalize(self, _stop_process, self._process, self._ipc_dir)
        try:
            ready = self._wait_until_ready(startup_timeout_s)
        except BaseException:
            self._close()
            raise
        super().__init__(tokenizer=Tokenizer(ready.tokenizer), model_path=ready.model_path, stage=ready.stage,
                         max_model_len=ready.max_model_len, vocab_size=ready.vocab_size,
                         eos_token_ids=tuple(ready.eos_token_ids), engine_args=ready.engine_args,
                         log_stats_interval=log_stats_interval, stat_loggers=stat_loggers,
                         cache_configs={0: ready.cache_config})
        self.engine_pid = ready.pid
        self._thread = threading.Thread(target=self._run_output_loop, name="stagedserve-output", daemon=True)
        self._thread.start()
        logger.info("engine core running in process %d", self.engine_pid)

    def _wait_until_ready(self, timeout_s: float) -> EngineCoreReady:
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
                message = output_decoder.decode(self._output.recv())
                if isinstance(message, EngineCoreReady):
                    return message
                if isinstance(message, EngineCoreStartupError):
                    if message.error_type == "ValueError":
                        raise ValueError(message.message)
                    raise RuntimeError(f"the engine core process failed to start: {message.error_type}: "
                                       f"{message.message}\n{message.traceback}")
            elif events:  # the sentinel: the child is gone without a word
                self._process.join(1)
                raise RuntimeError(f"the engine core process exited during start-up "
                                   f"(exit code {self._process.exitcode})")

    # ---- the transport -----------------------------------------------------------------------
    def _send(self, message: EngineCoreInput) -> None:
        """Send without blocking; with no engine process at the other end, raise ``EngineDeadError``."""
        with self._input_lock:
            try:
                if not self._input.closed:
                    self._input.send(encoder.encode(message), zmq.NOBLOCK)
                    return
            except zmq.Again:
                pass
        raise EngineDeadError("the engine core process is not taking requests")

    def _core_alive(self) -> bool:
        return self._process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core process; requests still in flight fail with ``EngineDeadError``."""
        if self._stopping:
            return
        self._stopping = True
        self._send_quietly(Shutdown())
        self._process.join(timeout)
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the server is shutting down"), "abort")
        self._close()

    def _run_output_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(OUTPUT_POLL_MS))
                if self._output in events:
                    while True:
                        try:
                            message = output_decoder.decode(self._output.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        if isinstance(message, EngineCoreOutputs):
                            self._on_outputs(message)
                elif events and not self._stopping:  # the sentinel: the child died
                    self._process.join(1)
                    self._engine_died(f"the engine core process died (exit code {self._process.exitcode})")
                    return
                self.log_stats_if_due()
        except BaseException as exc:  # a bug here must fail the clients loudly, never hang them
            if self._stopping:
                return
            logger.exception("output thread crashed")
            self._engine_died(f"the output thread crashed: {exc!r}")

    def _close(self) -> None:
        self._finalizer()  # stop the child if it still runs, remove the socket directory
        with self._input_lock:
            self._input.close()
        self._output.close()
        self._context.term()


def _stop_process(process: multiprocessing.Process, ipc_dir: str, timeout: float = 5.0) -> None:
    """Make sure the child is gone (a clean exit first), then remove its socket directory."""
    stop_process(process, timeout, grace=timeout)
    shutil.rmtree(ipc_dir, ignore_errors=True)

