"""The engine modes the reliability suite holds to the same promises: the engine core on a thread of the server
(``in-process``), in a process of its own (``engine-process``, the server's default), and two data-parallel engine
cores behind a coordinator (``dp2``); and, for the slow tests, the model split over two worker processes by tensor
or pipeline parallelism (``tp2``, ``pp2``) or over two Ray actors (``ray-tp2``, ``ray-pp2``: a Ray instance for
this host alone), each under an engine-core process.

Each process mode's engine starts once per module and xdist worker group (``xdist_group``), since
starting engine processes costs seconds; faults reach its engine cores through the engine plugin of
``engine_faults.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from stage5_server.data_parallel.launcher import environment
from stage5_server.engine import AsyncEngine, make_async_llm
from tests.reliability.engine_faults import EngineFaults, install
from tests.reliability.served import has_ray
from tests.stage5.server_fixtures import ENGINE_KWARGS, make_llm

MODES = ("in-process", "engine-process", "dp2")
SPLIT_MODES = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2),
               "ray-tp2": dict(tensor_parallel_size=2, distributed_executor_backend="ray"),
               "ray-pp2": dict(pipeline_parallel_size=2, distributed_executor_backend="ray")}


def mode_params(module: str, modes: tuple[str, ...] = MODES, slow: tuple[str, ...] = ()) -> list:
    """``modes`` as pytest params; each process mode's tests run on one xdist worker, so its engine starts once.
    The split modes, and those named in ``slow``, are marked slow."""
    def marks(mode: str) -> list:
        if mode == "in-process":
            return []
        group = [pytest.mark.xdist_group(f"{module}-{mode}")]
        if mode not in SPLIT_MODES:
            return [*group, *([pytest.mark.slow] if mode in slow else [])]
        needs_ray = [pytest.mark.skipif(not has_ray(), reason="needs ray")] if mode.startswith("ray") else []
        return [*group, pytest.mark.slow, *needs_ray]

    return [pytest.param(mode, id=mode, marks=marks(mode)) for mode in modes]


def make_engine(mode: str, model, faults: EngineFaults | None = None, **overrides: Any):
    """What ``create_app`` serves in ``mode``: an ``LLM`` (wrapped in the app's in-process ``AsyncLLM``) or an
    ``AsyncEngine`` over engine-core processes. ``faults``: let the test slow or fail the engine's steps."""
    kwargs = {**ENGINE_KWARGS, **overrides}
    if mode == "in-process":
        llm = make_llm(model, **overrides)
        if faults is not None:
            install(llm, faults.directory)
        return llm
    # The engine-core processes inherit this environment. One torch thread each: on a machine busier than its
    # cores (a test run), idle OpenMP threads spinning in two processes would burn more than the model does.
    with environment({"OMP_NUM_THREADS": "1", **(faults.env if faults is not None else {})}):
        if mode == "engine-process":
            return make_async_llm(str(model), engine_process=True, log_stats_interval=None, **kwargs)
        if mode == "dp2":
            return make_async_llm(str(model), data_parallel_size=2, log_stats_interval=None, **kwargs)
        if mode in SPLIT_MODES:
            return make_async_llm(str(model), engine_process=True, log_stats_interval=None,
                                  **{**SPLIT_MODES[mode], **kwargs})
    raise ValueError(f"mode: one of {', '.join([*MODES, *SPLIT_MODES])}, got {mode!r}")


def shutdown(engine) -> None:
    """Stop an engine of ``make_engine`` (the app stops an ``LLM``'s own)."""
    if isinstance(engine, AsyncEngine):
        engine.shutdown()


def num_ranks(mode: str) -> int:
    return 2 if mode == "dp2" else 1
