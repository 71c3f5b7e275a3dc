"""Serving processes as a parent sees them: each names itself (``ss-api-0``, ``ss-engine-1``,
``ss-coordinator``, ``ss-tp-0``, ...), so ``ps``, ``top`` and psutil show the topology by role, every
child sets up its signals and log lines the same way, and every parent stops its children the same
way. A leaf module: the tensor-parallel workers use it too.

vLLM: ``set_process_title`` in ``vllm/utils/system_utils.py`` (its processes show as
``VLLM::EngineCore``, ``VLLM::Worker``), and ``shutdown`` in ``vllm/v1/utils.py`` (SIGTERM, a wait,
then SIGKILL; here a child may first be given time to exit cleanly)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import time

logger = logging.getLogger("stagedserve")


def set_process_name(name: str) -> None:
    """This process's ``comm`` (15 characters; Linux only, a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # unwinds the process's loop: its sockets close, its parent sees it end


def configure_child(name: str, log_prefix: str, log_level: int, *, signals: bool = True) -> None:
    """A spawned child: its name; SIGTERM exits cleanly and SIGINT is left to the parent (``signals``);
    log lines that say which process wrote them."""
    set_process_name(name)
    if signals:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(format=f"%(levelname)s %(asctime)s [{log_prefix} pid %(process)d] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    logger.setLevel(log_level)


def stop_processes(processes: list[multiprocessing.Process], timeout: float = 5.0, grace: float = 0.0) -> None:
    """Make sure children are gone: up to ``grace`` seconds for clean exits, then SIGTERM and up to
    ``timeout`` seconds (a drain), then SIGKILL (logged)."""
    for stop, wait_s in ((None, grace), ("terminate", timeout), ("kill", timeout)):
        alive = [p for p in processes if p.is_alive()]
        for process in alive if stop else ():
            if stop == "kill":
                logger.error("%s (pid %d) did not stop in time; killing it", process.name, process.pid)
            getattr(process, stop)()
        deadline = time.monotonic() + wait_s
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
