"""``MPAsyncLLM``: the front end in this process, over one or more engine-core processes.

    add_request -> a live engine core (routing.py, when there are several) -> its input socket (PUSH)
    every core's output socket (DEALER, this API server's identity) -> output thread: _on_outputs
    coordinator (SUB, data parallelism only) -> every core's newest stats: routing, /metrics per rank

The cores step while this process parses HTTP and detokenizes: no turns under one GIL. By
default it starts one core as its child (``data_parallel_size`` N starts N, with a coordinator);
``connect`` joins cores another process started (``--api-server-count`` > 1). A core whose
connection drops, or whose tensor-parallel group broke, fails only its requests in flight
(HTTP 500) and gets no more; ``/health`` is 503 once no core is left. ``shutdown`` (or a
finalizer at exit) stops the cores this front end started.

vLLM: ``AsyncMPClient``, ``DPAsyncMPClient`` and ``DPLBAsyncMPClient`` in
``vllm/v1/engine/core_client.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.named_models import default_model, resolve_model
from shared.tokenizer import Tokenizer
from stage5_server.core.messages import (
    AbortRequests,
    AddRequest,
    ClientHello,
    ClientWelcome,
    EngineCoreInput,
    EngineCoreOutputs,
    UtilityCall,
    UtilityOutput,
    drain,
    encoder,
    open_socket,
    output_decoder,
    stats_update_decoder,
)
from stage5_server.core.stats import SchedulerStats
from stage5_server.data_parallel.launcher import DEFAULT_STARTUP_TIMEOUT_S, CoreEngineProcManager, EngineTopology
from stage5_server.data_parallel.routing import LEAST_LOADED, Router, rank_load
from stage5_server.engine.frontend import AsyncEngine, StatLoggerBase, dead_core_stats
from stage5_server.errors import EngineDeadError, EngineError

logger = logging.getLogger("stagedserve")

OUTPUT_POLL_MS = 100
HANDSHAKE_TIMEOUT_S = 60.0


@dataclasses.dataclass
class _Rank:
    """What this API server knows of one engine core."""

    index: int
    push: zmq.Socket  # requests and aborts to it
    dealer: zmq.Socket  # its outputs to us
    monitor: zmq.Socket  # the dealer's connection events
    alive: bool = True
    stats: SchedulerStats = dataclasses.field(default_factory=SchedulerStats)
    stats_seq: int = -1
    in_flight: int = 0  # this API server's requests on it

    def take_stats(self, stats: SchedulerStats, seq: int) -> None:
        if seq > self.stats_seq:
            self.stats, self.stats_seq = stats, seq


def combine_stats(all_stats: list[SchedulerStats]) -> SchedulerStats:
    """Counts summed over the ranks (the step histogram bucket by bucket, the drafts' counts with their own
    sum); KV usage as the mean. One rank's are its own (a copy)."""
    if len(all_stats) == 1:
        return dataclasses.replace(all_stats[0])
    total = SchedulerStats()
    for stats in all_stats:
        for f in dataclasses.fields(SchedulerStats):
            mine, theirs = getattr(total, f.name), getattr(stats, f.name)
            if isinstance(theirs, tuple):  # entry by entry (ranks may have seen different lengths)
                width = max(len(mine), len(theirs))
                setattr(total, f.name, tuple(a + b for a, b in zip(mine + (0,) * (width - len(mine)),
                                                                   theirs + (0,) * (width - len(theirs)))))
            elif f.name in ("weight_version", "sleep_level"):  # states, not counts
                setattr(total, f.name, max(mine, theirs))
            elif f.name != "kv_cache_usage":
                setattr(total, f.name, mine + theirs)
    total.kv_cache_usage = sum(s.kv_cache_usage for s in all_stats) / len(all_stats) if all_stats else 0.0
    return total


class MPAsyncLLM(AsyncEngine):
    """An ``AsyncEngine`` over engine-core processes. Start-up raises ``ValueError`` for a bad engine
    argument, ``RuntimeError`` when a core fails, ``TimeoutError`` after ``startup_timeout_s``."""

    engine_process = True

    def __init__(self, model: str | None = None, *, data_parallel_size: int = 1, routing: str = LEAST_LOADED,
                 log_stats_interval: float | None = 10.0, stat_loggers: list[StatLoggerBase] | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, **engine_args: Any):
        # A .gguf file is converted once here, before the cores start; they get the argument as given,
        # so that each finds the same directory and knows the file it came from (its quantized blocks).
        resolve_model(model) if model else default_model()
        manager = CoreEngineProcManager(model, engine_args, data_parallel_size, routing=routing,
                                        startup_timeout_s=startup_timeout_s)
        try:
            self._attach(manager.topology, 0, log_stats_interval, stat_loggers, manager, HANDSHAKE_TIMEOUT_S)
        except BaseException:
            manager.shutdown()
            raise

    @classmethod
    def connect(cls, topology: EngineTopology, *, client_index: int = 0, log_stats_interval: float | None = 10.0,
                stat_loggers: list[StatLoggerBase] | None = None,
                handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> MPAsyncLLM:
        """A front end, as API server ``client_index``, over the running cores of ``topology``."""
        engine = cls.__new__(cls)
        engine._attach(topology, client_index, log_stats_interval, stat_loggers, None, handshake_timeout_s)
        return engine

    def _attach(self, topology: EngineTopology, client_index: int, log_stats_interval: float | None,
                stat_loggers: list[StatLoggerBase] | None, owner: CoreEngineProcManager | None,
                handshake_timeout_s: float) -> None:
        ready = topology.ready[0]
        super().__init__(tokenizer=Tokenizer(ready.tokenizer), model_path=ready.model_path, stage=ready.stage,
                         max_model_len=ready.max_model_len, vocab_size=ready.vocab_size,
                         eos_token_ids=tuple(ready.eos_token_ids), engine_args=ready.engine_args,
                         log_stats_interval=log_stats_interval, stat_loggers=stat_loggers,
                         cache_configs={r.engine_index: r.cache_config for r in topology.ready})
        self.topology = topology
        self.client_id = f"api{client_index}-{os.getpid()}"
        self.client_index, self.client_count = client_index, topology.api_server_count
        self.engine_pids = [r.pid for r in topology.ready]
        self._owner = owner
        self._router = Router(topology.routing, int(ready.engine_args["block_size"]),
                              slack=max(1, int(ready.engine_args["max_num_seqs"]) // 2))
        self._route_lock = threading.Lock()  # the routing table, the ranks' counts and their push sockets
        self._rank_of: dict[str, int] = {}  # request id -> the rank it went to
        self._context = zmq.Context()
        self._ranks = [self._connect(d, topology) for d in range(topology.data_parallel_size)]
        self._stats_sub = None if topology.stats_address is None else open_socket(
            self._context, zmq.SUB, connect=topology.stats_address, LINGER=0, SUBSCRIBE=b"")
        try:
            self._handshake(handshake_timeout_s)
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._run_output_loop, name="stagedserve-output", daemon=True)
        self._thread.start()
        logger.info("API server %s: %d engine core(s) (pids %s), routing %s", self.client_id, len(self._ranks),
                    ", ".join(map(str, self.engine_pids)), topology.routing)

    @property
    def engine_pid(self) -> int:
        """The process of the first engine core (the only one without data parallelism)."""
        return self.engine_pids[0]

    @property
    def manager(self) -> CoreEngineProcManager | None:
        """The engine cores' launcher, when this front end started them."""
        return self._owner

    # ---- connections ---------------------------------------------------------------------------
    def _connect(self, d: int, topology: EngineTopology) -> _Rank:
        push = open_socket(self._context, zmq.PUSH, connect=topology.input_addresses[d], LINGER=0, SNDHWM=0)
        dealer = open_socket(self._context, zmq.DEALER, LINGER=0, ROUTING_ID=self.client_id.encode())
        monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        dealer.connect(topology.output_addresses[d])
        return _Rank(d, push, dealer, monitor, alive=d not in topology.dead_ranks)

    def _handshake(self, timeout_s: float) -> None:
        """Hello to every live rank; wait for each welcome (a rank that dies meanwhile counts as dead)."""
        waiting = {rank.index: rank for rank in self._ranks if rank.alive}
        for rank in waiting.values():
            rank.dealer.send(encoder.encode(ClientHello(self.client_id)))
        poller = self._poller(waiting.values())
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            events = dict(poller.poll(100))
            for d, rank in list(waiting.items()):
                if rank.dealer in events:
                    message = output_decoder.decode(rank.dealer.recv())
                    if isinstance(message, ClientWelcome):
                        rank.take_stats(message.scheduler_stats, message.stats_seq)
                        del waiting[d]
                if rank.monitor in events and recv_monitor_message(rank.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                    rank.alive = False
                    del waiting[d]
        for rank in waiting.values():
            logger.error("engine core rank %d did not answer within %g s; not routing to it", rank.index, timeout_s)
            rank.alive = False
        if not any(rank.alive for rank in self._ranks):
            raise RuntimeError("no engine core answered")

    # ---- the transport -------------------------------------------------------------------------
    def _send(self, message: EngineCoreInput) -> None:
        with self._route_lock:
            if isinstance(message, AddRequest):
                rank = self._route(message)
                rank.push.send(encoder.encode(AddRequest(message.request, self.client_id)), zmq.NOBLOCK)
                self._rank_of[message.request.request_id] = rank.index
                rank.in_flight += 1
            elif isinstance(message, AbortRequests):
                by_rank: dict[int, list[str]] = {}
                for rid in message.request_ids:
                    d = self._forget_route(rid)
                    if d is not None:
                        by_rank.setdefault(d, []).append(rid)
                for d, ids in by_rank.items():
                    if self._ranks[d].alive:
                        self._ranks[d].push.send(encoder.encode(AbortRequests(ids)), zmq.NOBLOCK)

    def _send_utility(self, call: UtilityCall) -> int:
        """To every live engine core (each has its own weights); each answers."""
        with self._route_lock:
            live = [rank for rank in self._ranks if rank.alive]
            if self._stopping or not live:
                raise EngineDeadError("the engine is not running")
            message = encoder.encode(msgspec.structs.replace(call, client_id=self.client_id))
            for rank in live:
                rank.push.send(message, zmq.NOBLOCK)
        return len(live)

    def _route(self, message: AddRequest) -> _Rank:
        """The live rank for a new request (caller holds ``_route_lock``)."""
        if self._stopping:
            raise EngineDeadError("the engine is not running (shut down)")
        loads = {r.index: rank_load(r.stats.num_waiting, r.stats.num_running, r.in_flight, self.client_count)
                 for r in self._ranks if r.alive}
        if not loads:
            raise EngineDeadError("the engine is not running (every engine core has died)")
        request = message.request
        return self._ranks[self._router.choose(loads, request.prompt_token_ids, request.cache_salt)]

    def _forget_route(self, request_id: str) -> int | None:
        d = self._rank_of.pop(request_id, None)
        if d is not None:
            self._ranks[d].in_flight -= 1
        return d

    def _core_alive(self) -> bool:
        return any(rank.alive for rank in self._ranks)

    @property
    def stats(self) -> SchedulerStats:
        """Every rank's newest stats, combined (the stats log line)."""
        return combine_stats([self._rank_stats(r) for r in self._ranks])

    @property
    def stats_by_engine(self) -> dict[int, SchedulerStats]:
        return {rank.index: self._rank_stats(rank) for rank in self._ranks}

    @staticmethod
    def _rank_stats(rank: _Rank) -> SchedulerStats:
        return rank.stats if rank.alive else dead_core_stats(rank.stats)

    def rank_of(self, request_id: str) -> int | None:
        """The rank an in-flight request was sent to."""
        with self._route_lock:
            return self._rank_of.get(request_id)

    def live_ranks(self) -> list[int]:
        return [rank.index for rank in self._ranks if rank.alive]

    @property
    def in_flight_by_engine(self) -> dict[int, int]:
        """This API server's requests in flight on each rank."""
        with self._route_lock:
            return {rank.index: rank.in_flight for rank in self._ranks}

    def _update_stats(self, message: EngineCoreOutputs) -> None:
        self._ranks[message.engine_index].take_stats(message.scheduler_stats, message.stats_seq)

    # ---- outputs (the output thread) -----------------------------------------------------------
    @staticmethod
    def _poller(ranks, *sockets: zmq.Socket | None) -> zmq.Poller:
        """A poller of the ranks' outputs and connection events, and of ``sockets``."""
        poller = zmq.Poller()
        for sock in [s for rank in ranks for s in (rank.dealer, rank.monitor)] + list(sockets):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        return poller

    def _run_output_loop(self) -> None:
        poller = self._poller(self._ranks, self._stats_sub)
        try:
            while not self._stopping:
                events = dict(poller.poll(OUTPUT_POLL_MS))
                for rank in self._ranks:
                    if rank.dealer in events:
                        self._drain(rank)
                    if rank.monitor in events:
                        event = recv_monitor_message(rank.monitor)
                        if event["event"] == zmq.EVENT_DISCONNECTED and rank.alive and not self._stopping:
                            self._drain(rank)  # what it sent before it went
                            self._rank_died(rank, f"engine core rank {rank.index} died")
                if self._stats_sub is not None and self._stats_sub in events:
                    self._take_stats_update()
                self.log_stats_if_due()
        except BaseException as exc:  # a bug here must fail the clients loudly, never hang them
            if self._stopping:
                return
            logger.exception("output thread crashed")
            for rank in self._ranks:
                rank.alive = False
            self._engine_died(f"the output thread crashed: {exc!r}")

    def _drain(self, rank: _Rank) -> None:
        for message in drain(rank.dealer, output_decoder):
            if isinstance(message, EngineCoreOutputs):
                self._on_rank_outputs(rank, message)
            elif isinstance(message, UtilityOutput):
                self.utilities.on_output(message)

    def _on_rank_outputs(self, rank: _Rank, message: EngineCoreOutputs) -> None:
        failed = message.failed
        with self._route_lock:
            for output in message.outputs:
                if output.finish_reason is not None:
                    self._forget_route(output.request_id)
            for rid in failed.request_ids if failed is not None else ():
                self._forget_route(rid)
        if failed is not None and failed.engine_dead:  # its TP group broke: the rank is gone for good
            rank.alive = False
            message.failed = msgspec.structs.replace(failed, engine_dead=False,
                                                     error=f"engine core rank {rank.index} failed: {failed.error}")
        self._on_outputs(message)
        if not self._core_alive():
            self._dead = EngineDeadError("every engine core has died")

    def _take_stats_update(self) -> None:
        updates = drain(self._stats_sub, stats_update_decoder)
        for report in updates[-1].engines if updates else ():  # only the newest matters
            self._ranks[report.engine_index].take_stats(report.scheduler_stats, report.stats_seq)

    def _rank_died(self, rank: _Rank, why: str) -> None:
        """Fail the requests in flight on ``rank`` (500) and route no more to it."""
        with self._route_lock:
            rank.alive = False
            lost = [rid for rid, d in self._rank_of.items() if d == rank.index]
            for rid in lost:
                self._forget_route(rid)
        logger.error("%s; failing its %d in-flight request(s); %d rank(s) left", why, len(lost), len(self.live_ranks()))
        self.utilities.senders_gone(f"{why} before it answered")
        self._fail(lost, EngineError(f"{why} while running this request"), "error")
        if not self._core_alive():
            self._dead = EngineDeadError("every engine core has died")

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving (requests in flight fail with ``EngineDeadError``); stop the cores if this started them."""
        if self._stopping:
            return
        self._stopping = True
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the server is shutting down"), "abort")
        self._close()
        if self._owner is not None:
            self._owner.shutdown(timeout)

    def _close(self) -> None:
        with self._route_lock:
            for rank in self._ranks:
                for sock in (rank.push, rank.dealer, rank.monitor):
                    sock.close(linger=0)
            if self._stats_sub is not None:
                self._stats_sub.close(linger=0)
        self._context.term()

