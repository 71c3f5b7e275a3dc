"""The data-parallel coordinator: one process, when DP > 1, that gathers every rank's load and
publishes it to every API server.

    engine core rank d --EngineStats, after each published step--> [PULL] coordinator
    coordinator [PUB] --EngineStatsUpdate, on change, at most every 100 ms--> [SUB] every API server

One message an interval per API server instead of DP x A a step; republished every second for a
late (restarted) API server. It exits with its parent or on SIGTERM, and ignores SIGINT.

vLLM: ``DPCoordinator`` / ``CoordinatorProc`` in ``vllm/v1/engine/coordinator.py`` (which also runs
the "request wave" protocol for expert-parallel ranks; dense models need none of it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import weakref

import zmq

from stage5_server.core.messages import EngineStats, EngineStatsUpdate, drain, encoder, open_socket, stats_decoder
from stage5_server.processes import configure_child, stop_processes

logger = logging.getLogger("stagedserve")

PUBLISH_INTERVAL_S = 0.1  # vLLM's min_stats_update_interval_ms
REPUBLISH_INTERVAL_S = 1.0  # unchanged stats go out this often anyway, for subscribers that joined late
PARENT_CHECK_S = 0.5


class DPCoordinator:
    """The coordinator process, started by ``launcher.CoreEngineProcManager``; stopped with it."""

    def __init__(self, num_engines: int, stats_address: str, publish_address: str,
                 log_level: int = logging.INFO):
        self.stats_address = stats_address  # the engine cores connect here
        self.publish_address = publish_address  # the API servers subscribe here
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_coordinator, name="stagedserve-dp-coordinator",
            args=(num_engines, stats_address, publish_address, os.getpid(), log_level), daemon=True)
        self.process.start()
        self._finalizer = weakref.finalize(self, stop_processes, [self.process])

    @property
    def pid(self) -> int:
        return self.process.pid

    def shutdown(self) -> None:
        self._finalizer()


def run_coordinator(num_engines: int, stats_address: str, publish_address: str, parent_pid: int,
                    log_level: int = logging.INFO) -> None:
    configure_child("ss-coordinator", "dp-coordinator", log_level)
    context = zmq.Context()
    stats_in = open_socket(context, zmq.PULL, bind=stats_address, LINGER=0)
    publish = open_socket(context, zmq.PUB, bind=publish_address, LINGER=0)
    latest: list[EngineStats | None] = [None] * num_engines
    changed, last_publish = False, 0.0
    try:
        while os.getppid() == parent_pid:
            now = time.monotonic()
            due = last_publish + (PUBLISH_INTERVAL_S if changed else REPUBLISH_INTERVAL_S)
            if stats_in.poll(int(1000 * max(0.0, min(due - now, PARENT_CHECK_S)))):
                for report in drain(stats_in, stats_decoder):
                    held = latest[report.engine_index]
                    if held is None or report.stats_seq > held.stats_seq:
                        latest[report.engine_index] = report
                        changed = True
            now = time.monotonic()
            if now >= last_publish + (PUBLISH_INTERVAL_S if changed else REPUBLISH_INTERVAL_S):
                publish.send(encoder.encode(EngineStatsUpdate([s for s in latest if s is not None])))
                changed, last_publish = False, now
    finally:
        stats_in.close()
        publish.close()
        context.term()
