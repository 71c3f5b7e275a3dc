"""The engine core in a process of its own: the core loop between ZeroMQ sockets.

The API servers (``engine/mp_client.MPAsyncLLM``) own HTTP, tokenization and streaming; this
process owns the scheduler, the KV cache and the model, and never sees text. It binds its sockets,
reports to the launcher (``data_parallel/launcher.py``) once built, and serves every API server
that connects, each request's outputs to the API server that sent it, in the Structs of
``messages.py`` as msgpack:

    handshake (PUSH)       -> EngineCoreReady | EngineCoreStartupError, once, to the launcher
    input  (PULL, bound)   <- AddRequest (naming its API server) | AbortRequests | ClientGone | Shutdown
    output (ROUTER, bound) <- ClientHello;  -> ClientWelcome, then each API server's own EngineCoreOutputs
    stats  (PUSH)          -> EngineStats to the coordinator, when there is one (DP > 1)

One engine core behind one API server is the same process with one client. It exits on
``Shutdown``, on SIGTERM or, at once, when its parent is gone, and ignores SIGINT (the parent decides).

vLLM: ``EngineCoreProc`` in ``vllm/v1/engine/core.py`` (which also moves socket I/O onto two
threads to overlap a GPU step).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import zmq

from stage5_server.core.busy_loop import EngineCoreLoop
from stage5_server.core.messages import (
    AddRequest,
    ClientGone,
    ClientHello,
    ClientWelcome,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreStartupError,
    EngineStats,
    FailedRequests,
    UtilityCall,
    UtilityOutput,
    drain,
    encoder,
    hello_decoder,
    input_decoder,
    open_socket,
    plain,
)

if TYPE_CHECKING:
    from stage5_server.core.engine_core import EngineCore

logger = logging.getLogger("stagedserve")

SEND_TIMEOUT_MS = 5000  # a send blocks only when no API server is connected: then give up
# Without a coordinator (one rank behind several API servers) the core itself tells the API servers
# that sent nothing this step its newest stats, at most this often (vLLM's coordinator rate).
STATS_BROADCAST_INTERVAL_S = 0.1


class ZmqCoreLoop(EngineCoreLoop):
    """The core loop of one engine-core process, serving every API server that said hello (module docstring)."""

    def __init__(self, core: EngineCore, engine_index: int, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 stats_socket: zmq.Socket | None, parent_pid: int):
        super().__init__(core)
        self.engine_index = engine_index
        self.input = input_socket
        self.output = output_socket
        self.stats_socket = stats_socket  # to the coordinator; None: broadcast to the API servers instead
        self.parent_pid = parent_pid
        self.orphaned = False  # set once the parent is gone (``keep_running``)
        self.clients: set[str] = set()  # API servers that said hello and are not known to be gone
        self.client_of: dict[str, str] = {}  # request id -> the API server that sent it
        self.stats_seq = 0
        self._stats_owed = False  # some API server has not seen the newest stats (no coordinator)
        self._last_broadcast = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self.input, zmq.POLLIN)
        self._poller.register(self.output, zmq.POLLIN)

    # ---- inputs --------------------------------------------------------------------------------
    def receive(self, timeout_s: float) -> list[EngineCoreInput]:
        if self._stats_owed:  # wake up in time to broadcast them
            timeout_s = min(timeout_s, max(0.0, self._last_broadcast + STATS_BROADCAST_INTERVAL_S - time.monotonic()))
        messages: list[EngineCoreInput] = []
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self.output in events:
            while True:
                try:
                    identity, payload = self.output.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.welcome(identity.decode(), hello_decoder.decode(payload))
        if self.input in events:
            messages.extend(drain(self.input, input_decoder))
        return messages

    def welcome(self, client_id: str, hello: ClientHello) -> None:
        assert hello.client_id == client_id, (hello.client_id, client_id)
        self.clients.add(client_id)
        logger.info("API server %s connected", client_id)
        self.send_to(client_id, ClientWelcome(self.engine_index, self.core.stats(), self.stats_seq))

    def handle(self, messages: list[EngineCoreInput]) -> None:
        for message in messages:
            if isinstance(message, AddRequest) and message.client_id is not None:
                self.client_of[message.request.request_id] = message.client_id
            elif isinstance(message, UtilityCall) and message.client_id is None:
                message.client_id = next(iter(self.clients), None)  # one API server: the only one
            elif isinstance(message, ClientGone):
                self.drop_client(message.client_id, "its supervisor saw it exit")
        super().handle(messages)

    def abort(self, request_ids: list[str]) -> None:
        super().abort(request_ids)
        for rid in request_ids:
            self.client_of.pop(rid, None)

    def drop_client(self, client_id: str, why: str) -> None:
        """An API server is gone: abort its requests (their KV returns to the pool)."""
        orphans = [rid for rid, owner in self.client_of.items() if owner == client_id]
        if client_id in self.clients or orphans:
            logger.warning("API server %s is gone (%s); aborting its %d request(s)", client_id, why, len(orphans))
        self.clients.discard(client_id)
        self.abort(orphans)

    # ---- outputs -------------------------------------------------------------------------------
    def publish(self, outputs: EngineCoreOutputs) -> None:
        """Each API server gets the outputs of its own requests, with this rank's stats."""
        self.stats_seq += 1
        stats = outputs.scheduler_stats
        by_client: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        for output in outputs.outputs:
            owner = self.client_of.pop(output.request_id, None) if output.finish_reason is not None \
                else self.client_of.get(output.request_id)
            if owner is not None:
                by_client[owner].append(output)
        failed_by_client: dict[str, list[str]] = defaultdict(list)
        if outputs.failed is not None:
            for rid in outputs.failed.request_ids:
                owner = self.client_of.pop(rid, None)
                if owner is not None:
                    failed_by_client[owner].append(rid)
        for client_id in set(by_client) | set(failed_by_client):
            failed = outputs.failed
            mine = None if client_id not in failed_by_client else \
                FailedRequests(failed_by_client[client_id], failed.error, failed.engine_dead)
            self.send_to(client_id, EngineCoreOutputs(by_client.get(client_id, []), stats, mine, self.engine_index,
                                                      self.stats_seq))
        if self.stats_socket is not None:
            try:
                self.stats_socket.send(encoder.encode(EngineStats(self.engine_index, self.stats_seq, stats)),
                                       zmq.NOBLOCK)
            except zmq.Again:
                pass  # the coordinator is gone or behind: routing falls back on the API servers' own counts
        else:
            self._stats_owed = True
            self.broadcast_stats_if_due()

    def publish_utility(self, output: UtilityOutput, client_id: str | None) -> None:
        if client_id is not None:
            output.engine_index = self.engine_index
            self.send_to(client_id, output)

    def broadcast_stats_if_due(self) -> None:
        if not self._stats_owed or time.monotonic() < self._last_broadcast + STATS_BROADCAST_INTERVAL_S:
            return
        self._stats_owed = False
        self._last_broadcast = time.monotonic()
        message = EngineCoreOutputs([], self.core.stats(), None, self.engine_index, self.stats_seq)
        for client_id in list(self.clients):
            self.send_to(client_id, message)

    def send_to(self, client_id: str, message) -> None:
        try:
            self.output.send_multipart([client_id.encode(), encoder.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: no such peer connected any more
            self.drop_client(client_id, f"sending to it failed: {exc}")

    def keep_running(self) -> bool:
        self.broadcast_stats_if_due()
        self.orphaned = os.getppid() != self.parent_pid  # the parent was killed
        return not self.orphaned


def _build_core(model: str | None, engine_args: dict[str, Any], engine_index: int):
    """``(EngineCore, EngineCoreReady)``, or ``(None, EngineCoreStartupError)``."""
    try:
        from stage5_server.config import STAGE, EngineConfig
        from stage5_server.core.builder import build_engine_core
        from stage5_server.core.plugins import load_engine_plugins
        from stage5_server.core.stats import cache_config_info

        core = build_engine_core(EngineConfig.create(model, **engine_args))
        load_engine_plugins(core)
        config = core.config
    except BaseException as exc:
        return None, EngineCoreStartupError(type(exc).__name__, str(exc), traceback.format_exc(), engine_index)
    return core, EngineCoreReady(
        pid=os.getpid(), model_path=str(config.model_path), stage=STAGE, max_model_len=config.max_model_len,
        vocab_size=config.model_config.vocab_size, eos_token_ids=list(config.model_config.eos_token_ids),
        tokenizer=config.tokenizer_path, engine_args={k: plain(v) for k, v in config.args.items()},
        cache_config=cache_config_info(config.args, config.dtype, core.num_kv_blocks * config.cache.block_size),
        engine_index=engine_index)


def run_engine_core(engine_index: int, model: str | None, engine_args: dict[str, Any], input_address: str,
                    output_address: str, handshake_address: str, stats_address: str | None, parent_pid: int,
                    num_threads: int | None = None, log_level: int = logging.INFO) -> None:
    """The entry point of engine core ``engine_index`` (spawned by ``data_parallel/launcher.py``): bind,
    build the engine, report ``EngineCoreReady`` (or the start-up error) to the launcher, then serve
    every API server that connects. ``num_threads``: this rank's share of the CPU. A dead core exits 1."""
    from stage5_server.processes import configure_child

    configure_child(f"ss-engine-{engine_index}", f"engine-core {engine_index}", log_level)
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
    context = zmq.Context()
    input_socket = open_socket(context, zmq.PULL, bind=input_address, LINGER=0)
    # MANDATORY: a send to an API server that is not connected fails instead of vanishing.
    output_socket = open_socket(context, zmq.ROUTER, bind=output_address, LINGER=0, SNDHWM=0, ROUTER_MANDATORY=1)
    handshake = open_socket(context, zmq.PUSH, connect=handshake_address, LINGER=2000, SNDTIMEO=SEND_TIMEOUT_MS)
    stats_socket = None if stats_address is None else open_socket(context, zmq.PUSH, connect=stats_address,
                                                                  LINGER=0, SNDHWM=1000)
    try:
        built, ready = _build_core(model, engine_args, engine_index)
        handshake.send(encoder.encode(ready))
        if built is None:
            return
        loop = ZmqCoreLoop(built, engine_index, input_socket, output_socket, stats_socket, parent_pid)
        loop.run()
        if loop.orphaned:  # nobody is left to deliver to or to wait for: go at once
            logger.info("engine core %d exiting: its parent is gone", engine_index)
            for sock in (input_socket, output_socket, handshake, stats_socket):
                if sock is not None:
                    sock.close(linger=0)
            os._exit(0)  # skips lingering sends, thread-pool joins and exit handlers (seconds, all of them)
        logger.info("engine core %d exiting", engine_index)
        built.shutdown()  # the executor's workers, and a Ray instance it started, go with the core
        if loop.dead:
            raise SystemExit(1)
    except zmq.Again:
        logger.error("the launcher did not take the start-up report; exiting")
    finally:
        for sock in (input_socket, output_socket, handshake, stats_socket):
            if sock is not None:
                sock.close()
        context.term()
