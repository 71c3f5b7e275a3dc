"""Serving processes as a parent sees them: each names itself (``ss-api-0``, ``ss-engine-1``,
``ss-coordinator``, ``ss-tp-0``, ...), so ``ps``, ``top`` and psutil show the topology by role, and
every parent stops a child the same way. A leaf module: the tensor-parallel workers use it too.

vLLM: ``set_process_title`` in ``vllm/utils/system_utils.py`` (its processes show as
``VLLM::EngineCore``, ``VLLM::Worker``), and ``shutdown`` in ``vllm/v1/utils.py`` (SIGTERM, a wait,
then SIGKILL; here a child may first be given time to exit cleanly)."""

from __future__ import annotations

import ctypes
import multiprocessing


def set_process_name(name: str) -> None:
    """This process's ``comm`` (15 characters; Linux only, a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def stop_process(process: multiprocessing.Process, timeout: float = 5.0, grace: float = 0.0) -> None:
    """Make sure a child is gone: wait ``grace`` seconds for a clean exit, then SIGTERM, then SIGKILL."""
    if grace and process.is_alive():
        process.join(grace)
    if process.is_alive():
        process.terminate()
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(timeout)
