"""The engine core's utilities: calls by name that run between two steps, never inside one.

``collective_rpc`` (a method on every worker, their results in rank order) and ``reset_prefix_cache`` are the
core's own. A system that is on registers more (``Utilities.register``): weight updates and sleep
(``weight_sync/core.py``), each saying whether it *drains*. Nothing here runs for a request: only calls.

A utility is reached two ways: directly (the offline ``LLM``, whose caller drives the steps), or as a
``UtilityCall`` message through the core's busy loop (``busy_loop.py``: the server's engine thread or
engine-core process), which queues each call and runs it between steps:

- a call is queued when it arrives; the loop runs the queue's head after handling its inputs and after each step;
- a call that drains waits until the core has no unfinished request; meanwhile each new request is *held*, in
  arrival order, not given to the scheduler, and admitted once the call has run; a held request that is aborted
  is dropped;
- any other call runs at once, still between steps; a call that raises answers with the error, and the engine
  goes on.

vLLM: ``EngineCore.collective_rpc`` and ``EngineCoreProc._handle_client_request`` (``UTILITY`` requests) in
``vllm/v1/engine/core.py``; the hold-and-resume is ``pause_generation(mode="wait")`` / ``resume_generation``
of ``vllm/v1/engine/async_llm.py``.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stage5_server.executor.abstract import resolve_obj_by_qualname, worker_method


@dataclass
class RankError:
    """A worker method's exception, sent back as a value: the rank lives on (a raise would stop it)."""

    type_name: str
    message: str
    traceback: str


@dataclass
class RankCall:
    """``method(worker, *args, **kwargs)`` on one rank; picklable when ``method`` is a name or an importable
    function. A name is the worker's method or its extension's; an unknown name or a raise comes back as a
    ``RankError``."""

    method: str | Callable
    kwargs: dict[str, Any]

    def __call__(self, worker: Any, *args: Any) -> Any:
        try:
            if isinstance(self.method, str):
                fn = None if self.method.startswith("_") else worker_method(worker, self.method)
                if fn is None:
                    raise ValueError(f"collective_rpc: the worker ({type(worker).__name__}) has no method "
                                     f"{self.method!r}")
                return fn(*args, **self.kwargs)
            return self.method(worker, *args, **self.kwargs)
        except Exception as exc:
            return RankError(type(exc).__name__, str(exc), traceback.format_exc())


@dataclass(frozen=True)
class Utility:
    fn: Callable[..., Any]
    drains: bool = False  # waits for the requests in the core to finish (new ones are held) before it runs


class Utilities:
    """The core's utilities by name (``EngineCore.utilities``)."""

    def __init__(self, core: Any):  # the EngineCore (engine_core.py), which imports this module
        self.core = core
        self.table = {"collective_rpc": Utility(self.collective_rpc),
                      "reset_prefix_cache": Utility(core.reset_prefix_cache)}
        # Worker methods whose state the core keeps: refused through the public collective_rpc, with what to call.
        self.core_only = {"execute_model": "LLM.generate", "initialize_kv_cache": "the engine core's start-up",
                          "shutdown": "LLM.shutdown"}
        self._worker_classes: list[type] | None = None  # resolved on the first call by name

    def register(self, name: str, fn: Callable[..., Any], drains: bool = False) -> None:
        self.table[name] = Utility(fn, drains)

    def drains(self, method: str) -> bool:
        utility = self.table.get(method)
        return utility is not None and utility.drains

    def run(self, method: str, args: tuple, kwargs: dict) -> Any:
        if method not in self.table:
            raise ValueError(f"unknown engine utility {method!r}; expected one of {sorted(self.table)}")
        return self.table[method].fn(*args, **kwargs)

    # ---- collective_rpc --------------------------------------------------------------------------------
    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """``method`` on every worker, their results in rank order (a name: a worker method). The methods whose
        state the core keeps (steps, the KV cache) are the core's to call."""
        if isinstance(method, str) and method in self.core_only:
            raise ValueError(f"collective_rpc: {method!r} is run by the engine core itself; use "
                             f"{self.core_only[method]}")
        return self.rpc(method, args, kwargs)

    def rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        """``collective_rpc`` without the core-only check (the core's own calls, and a registered system's)."""
        if isinstance(method, str):
            self._check_method_name(method)
        elif not callable(method):
            raise ValueError(f"collective_rpc: method must be a worker method's name or a callable, got "
                             f"{type(method).__name__}")
        elif self.core.model_executor.world_size > 1:
            try:
                pickle.dumps(method)
            except Exception as exc:
                raise ValueError(f"collective_rpc: the workers run in other processes and {method!r} cannot be "
                                 f"sent there ({exc}); pass a module-level function or a method name") from None
        results = self.core.model_executor.collective_rpc(RankCall(method, dict(kwargs or {})), *args)
        for rank, result in enumerate(results):
            if isinstance(result, RankError):  # the caller's method or arguments: the engine is as it was
                raise ValueError(f"{result.message} (rank {rank}, {result.type_name})")
        return results

    def _check_method_name(self, method: str) -> None:
        """Refuse a name neither the worker's class nor its extension's has (a factory's worker: checked on the
        rank instead)."""
        if self._worker_classes is None:
            config = self.core.config
            worker = resolve_obj_by_qualname(config.worker_cls)
            extension = config.worker_extension_cls and resolve_obj_by_qualname(config.worker_extension_cls)
            self._worker_classes = [worker, *filter(None, [extension])] if isinstance(worker, type) else []
        classes = self._worker_classes
        if not classes:
            return
        if method.startswith("_") or not any(callable(getattr(c, method, None)) for c in classes):
            public = sorted({n for c in classes for n in dir(c) if not n.startswith("_") and callable(getattr(c, n))})
            raise ValueError(f"collective_rpc: the worker ({classes[0].__name__}) has no method {method!r}; "
                             f"it has {public}")
