"""``AsyncLLM``: the engine core on a background thread of the server's own process.

The core is not thread-safe, so one "engine thread" runs the core loop (``core/busy_loop.py``) over
the core, fed through a queue; it shares one GIL with the HTTP event loop: simple to debug and to
read. ``MPAsyncLLM`` moves the core into a process of its own.

vLLM: ``InprocClient`` in ``vllm/v1/engine/core_client.py`` (the core in the caller's process).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from shared.tokenizer import Tokenizer
from stage5_server.config import STAGE, EngineConfig
from stage5_server.core.builder import build_engine_core
from stage5_server.core.busy_loop import EngineCoreLoop
from stage5_server.core.engine_core import EngineCore
from stage5_server.core.messages import EngineCoreInput, EngineCoreOutputs, Shutdown, UtilityCall, UtilityOutput, plain
from stage5_server.core.stats import cache_config_info
from stage5_server.engine.frontend import AsyncEngine, StatLoggerBase
from stage5_server.errors import EngineDeadError

logger = logging.getLogger("stagedserve")

THREAD_NAME = "stagedserve-engine"


class OfflineEngine(Protocol):
    """What ``AsyncLLM.from_llm`` takes of an offline ``LLM`` (``stage5_server/llm.py``, which imports this room)."""

    engine: EngineCore
    tokenizer: Tokenizer


class _ThreadCoreLoop(EngineCoreLoop):
    """The core loop fed from a queue; outputs go straight to the front end, on this thread."""

    def __init__(self, core: EngineCore, inputs: queue.SimpleQueue, deliver: Callable[[EngineCoreOutputs], None],
                 tick: Callable[[], None], idle_poll_s: float, answer: Callable[[UtilityOutput], None]):
        super().__init__(core, idle_poll_s)
        self.inputs = inputs
        self.deliver = deliver
        self.tick = tick
        self.answer = answer

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

    def publish_utility(self, output: UtilityOutput, client_id: str | None) -> None:
        self.answer(output)

    def keep_running(self) -> bool:
        self.tick()  # the stats line is due on time even while idle
        return True


class AsyncLLM(AsyncEngine):
    """Serve many concurrent requests from asyncio over an engine core stepped on a thread of this process
    (``from_config``: a core built here, and shut down with this; ``from_llm``: an ``LLM``'s core)."""

    engine_process = False

    def __init__(self, core: EngineCore, tokenizer: Tokenizer | None = None, *, owns_core: bool = False,
                 log_stats_interval: float | None = 10.0, stat_loggers: list[StatLoggerBase] | None = None,
                 idle_poll_s: float = 0.5):
        config = core.config
        capacity = core.num_kv_blocks * config.cache.block_size
        super().__init__(tokenizer=tokenizer or Tokenizer(config.tokenizer_path), model_path=str(config.model_path),
                         stage=STAGE, max_model_len=config.max_model_len, vocab_size=config.model_config.vocab_size,
                         eos_token_ids=tuple(config.model_config.eos_token_ids),
                         engine_args={k: plain(v) for k, v in config.args.items()},
                         log_stats_interval=log_stats_interval, stat_loggers=stat_loggers,
                         cache_configs={0: cache_config_info(config.args, config.dtype, capacity)})
        self.core = core
        self.owns_core = owns_core
        self._inputs: queue.SimpleQueue[EngineCoreInput] = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # so that nothing is queued after the engine thread's last look
        self._loop = _ThreadCoreLoop(core, self._inputs, self._on_outputs, self.log_stats_if_due, idle_poll_s,
                                     self.utilities.on_output)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        tokenizer = Tokenizer(config.tokenizer_path)
        return cls(build_engine_core(config, tokenizer), tokenizer, owns_core=True, **kwargs)

    @classmethod
    def from_llm(cls, llm: OfflineEngine, **kwargs: Any) -> AsyncLLM:
        """Over ``llm``'s engine core (its own front end stays unused; ``llm`` is not to step meanwhile)."""
        return cls(llm.engine, llm.tokenizer, **kwargs)

    def _send(self, message: EngineCoreInput) -> None:
        with self._send_lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")
            self._inputs.put(message)

    def _send_utility(self, call: UtilityCall) -> int:
        self._send(call)
        return 1

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
        if self.owns_core:
            self.core.shutdown()

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
            self.utilities.senders_gone("the server is shutting down")
            self._loop.abort(self.core.unfinished_request_ids())  # give their KV back
