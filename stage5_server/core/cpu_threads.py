"""How many threads torch gets on a CPU: every physical core for the engine, one for a front end.

torch's default, a thread per logical CPU, puts two threads on a hyper-threaded core's matrix
units and gives an HTTP-only process a full pool that competes with the engine. So the model's
process uses a thread per physical core it may run on (unless ``cpu_threads`` or
``OMP_NUM_THREADS`` says otherwise), a process that only serves HTTP one; the choice is logged.

vLLM: ``vllm/platforms/cpu.py`` and ``vllm/v1/worker/cpu_worker.py`` (``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("stagedserve")


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (logical CPUs where topology is unknown)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def configure_engine_threads(cpu_threads: int | None = None) -> str:
    """Give torch one thread per physical core (or ``cpu_threads``); returns the line it logged."""
    if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
        raise ValueError(f"cpu_threads: must be a positive integer, got {cpu_threads!r}")
    source = "cpu_threads"
    if cpu_threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        cpu_threads, source = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    if cpu_threads is None:
        cpu_threads, source = physical_cores(), "physical cores"
    torch.set_num_threads(cpu_threads)
    line = (f"CPU threads: torch uses {torch.get_num_threads()} ({source}; {os.cpu_count()} logical CPUs, "
            f"{physical_cores()} physical cores available)")
    logger.info(line)
    return line


def configure_frontend_threads() -> None:
    """A process that runs no model (the HTTP front end of a split server) keeps one torch thread."""
    torch.set_num_threads(1)
