"""``AsyncLLM``: the engine core on a background thread of the server's own process.

The core is not thread-safe, so one "engine thread" runs the core loop (``core_loop.py``) over
``llm.engine``, fed through a queue; it shares one GIL with the HTTP event loop: simple to debug
and to read. ``MPAsyncLLM`` moves the core into a process of its own.

vLLM: ``InprocClient`` in ``vllm/v1/engine/core_client.py`` (the core in the caller's process).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from shared.llm_base import BaseLLM, EngineCore
from shared.structured_output import StructuredOutputManager
from stage5_server.core.busy_loop import EngineCoreLoop
from stage5_server.core.errors import EngineDeadError
from stage5_server.core.messages import EngineCoreInput, EngineCoreOutputs, Shutdown
from stage5_server.engine.frontend import AsyncEngine, StatLoggerBase

logger = logging.getLogger("stagedserve")

THREAD_NAME = "stagedserve-engine"


class _ThreadCoreLoop(EngineCoreLoop):
    """The core loop fed from a queue; outputs go straight to the front end, on this thread."""

    def __init__(self, core: EngineCore, inputs: queue.SimpleQueue, deliver: Callable[[EngineCoreOutputs], None],
                 tick: Callable[[], None], idle_poll_s: float, grammars: StructuredOutputManager | None = None):
        super().__init__(core, idle_poll_s, grammars=grammars)
        self.inputs = inputs
        self.deliver = deliver
        self.tick = tick

    def receive(self, timeout_s: float) -> list[EngineCoreInput]:
        messages = []
        try:
            messages.append(self.inputs.get(timeout=timeout_s) if timeout_s > 0 else self.inputs.get_nowait())
            while True:
                messages.append(self.inputs.get_nowait())
        except queue.Empty:
            return messages

    def publish(self, outputs: EngineCoreOutputs) -> None:
        self.deliver(outputs)

    def keep_running(self) -> bool:
        self.tick()  # the stats line is due on time even while idle
        return True


class AsyncLLM(AsyncEngine):
    """Serve many concurrent requests from asyncio over ``llm``'s engine core, stepped on a thread."""

    engine_process = False

    def __init__(self, llm: BaseLLM, *, log_stats_interval: float | None = 10.0,
                 stat_loggers: list[StatLoggerBase] | None = None, idle_poll_s: float = 0.5):
        config = llm.model_config
        super().__init__(tokenizer=llm.tokenizer, model_path=str(llm.model_path), stage=llm.stage,
                         max_model_len=llm.max_model_len, vocab_size=config.vocab_size,
                         eos_token_ids=tuple(config.eos_token_ids), engine_args=dict(llm.args),
                         log_stats_interval=log_stats_interval, stat_loggers=stat_loggers,
                         cache_configs={0: llm.cache_config_info()})
        self.llm = llm
        self._inputs: queue.SimpleQueue[EngineCoreInput] = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # so that nothing is queued after the engine thread's last look
        self._loop = _ThreadCoreLoop(llm.engine, self._inputs, self._on_outputs, self.log_stats_if_due, idle_poll_s,
                                     llm.structured_output_manager)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _send(self, message: EngineCoreInput) -> None:
        with self._send_lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")
            self._inputs.put(message)

    def _core_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with ``EngineDeadError``."""
        with self._send_lock:
            if self._stopping:
                return
            self._stopping = True
            self._inputs.put(Shutdown())
        self._thread.join(timeout)

    def _run(self) -> None:
        crashed = None
        try:
            self._loop.run()
        except BaseException as exc:  # a bug in the loop: fail loudly, never hang the clients
            logger.exception("engine thread crashed")
            crashed = exc
        with self._send_lock:  # first refuse new messages: nobody will read the queue again
            self._stopping = True
        if crashed is not None:
            self._engine_died(f"the engine thread crashed: {crashed!r}")
        elif self._loop.dead:
            self._engine_died("the engine cannot run any more steps")
        else:
            self._dead = EngineDeadError("the server is shutting down")
            self._fail_all(self._dead, "abort")
            self._loop.abort(list(self._loop.requests))  # give their KV back
