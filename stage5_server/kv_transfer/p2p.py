"""Prefill/decode disaggregation: a prefill instance sends each block it completes to a decode instance.

A prompt's prefill is one big compute-bound step; decoding is many small memory-bound ones. On one engine
they share every step, so a long prefill holds up every decode in the batch (the seeds' DistServe
argument: time to first token and time per output token fight over the same steps). Split them: a
*producer* engine only prefills, a *consumer* engine only decodes, and the K/V crosses between them.

- **Producer** (``kv_role: kv_producer``), after each step's forward (``wait_for_save``): the blocks the
  step completed, every layer's K and V with their hashes, go to the consumer's address in one ZeroMQ
  message; the step waits for the consumer's answer (a few ms for a prompt on loopback), so once the
  producer has answered a request, its blocks are at the consumer. A consumer that does not answer in
  ``SEND_TIMEOUT_S`` is logged and skipped, and for ``RETRY_AFTER_S`` the steps send nothing: the
  producer's requests never fail for it, and only one step waits for it.
- **Consumer** (``kv_role: kv_consumer``): a thread of its engine core binds the address (loopback unless
  ``kv_host`` names another) and keeps what arrives in a bounded buffer, LRU by (transfer id, hash). Its
  scheduler side then finds a request's blocks there past the local prefix cache, as the offload tier does
  (``offload.py``), and the step that first reads them carries their K/V to the worker, which copies
  them into their blocks before the forward. The consumer recomputes only the last partial block.

Blocks are named by their prefix-cache hash, so the two engines must hash alike: the same model, block
size, sha256 and the request's same trust group (salt), adapter and images. A block also travels under the
*transfer id* of the request it was computed for: the proxy gives each request a fresh, random one and
sends it to both instances (``X-KV-Transfer-Id``; ``kv_transfer_params`` on the engine request). The
producer sends only blocks of requests that have one, and the consumer files what arrives under it: a
request there takes only the blocks sent for its own transfer id, never those sent for another request,
even with the same hashes. Nothing else is kept per request, so an aborted request leaves nothing behind
(its blocks age out of the LRU buffer), and a request that reaches the consumer without its blocks is
simply prefilled there.

Who is on the other end: CURVE keys drawn from a secret both instances share (``peer_auth.py``). A peer
without it neither receives K/V (the producer will not complete a handshake with it) nor sends any (the
consumer refuses it and logs its address). A message part is at most ``max_message_bytes`` (64 MiB by
default; a peer that sends more is disconnected), and the producer splits a step's blocks to fit.

The proxy in front of the pair is ``proxy.py``.

vLLM: ``P2pNcclConnector`` in ``vllm/distributed/kv_transfer/kv_connector/v1/p2p/`` (the producer sends
to the consumer as it saves each layer, keyed by request id; its sockets take whoever connects),
``NixlConnector`` (the consumer reads instead); ``examples/online_serving/disaggregated_serving/``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import zmq

from stage4_prefix_cache.kv_cache_utils import BlockHash
from stage5_server.kv_transfer.base import (
    FilledBlock,
    KVConnectorBase,
    KVConnectorMetadata,
    stored_run,
    transfer_id_of,
)
from stage5_server.kv_transfer.peer_auth import (
    ConsumerGuard,
    handshake_failed,
    kv_transfer_secret,
    secure_producer_socket,
)

logger = logging.getLogger("stagedserve")
SEND_TIMEOUT_S = 5.0
RETRY_AFTER_S = 30.0  # after a consumer failed to answer, steps send nothing for this long
DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}


@dataclass
class P2pMetadata(KVConnectorMetadata):
    sends: list[FilledBlock] = field(default_factory=list)  # producer: blocks to send after the forward
    loads: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # consumer: (block, K, V)


class P2pZmqConnector(KVConnectorBase):
    def __init__(self, config, role, block_size: int, layout: tuple[int, int, int, torch.dtype] | None = None):
        super().__init__(config, role, block_size)
        self.layout = layout  # (layers, kv_heads, head_dim, dtype): what a received block must be
        self.secret = kv_transfer_secret()
        self.context = zmq.Context()  # its own: a host process (a notebook's kernel) may use the shared one
        self.sender: zmq.Socket | None = None  # producer, worker side
        self.sender_monitor: zmq.Socket | None = None
        self.send_failures = 0
        self.send_again_at = 0.0  # monotonic time: after a failure, no sends before it
        # consumer, scheduler side: (transfer id, hash) -> (K, V) each [layers, block_size, kv_heads, head_dim],
        # oldest first
        self.received: OrderedDict[tuple[str, BlockHash], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.received_bytes = 0
        self.lock = threading.Lock()
        self.matched: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # request id -> the K, V it matched
        self.pending_loads: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.receiver: threading.Thread | None = None
        self.guard: ConsumerGuard | None = None
        self.stopping = threading.Event()
        if config.is_consumer and role.value == "scheduler":
            socket = self.context.socket(zmq.REP)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)  # a larger part: the peer is dropped
            self.guard = ConsumerGuard(self.context, socket, self.secret)
            try:
                socket.bind(config.address)
            except zmq.ZMQError as exc:
                socket.close()
                self.guard.close()
                raise OSError(f"kv_transfer_config: cannot listen on {config.address}: {exc}") from None
            self.receiver = threading.Thread(target=self._receive, args=(socket,), name="kv-receiver", daemon=True)
            self.receiver.start()

    # ---- consumer: the receiving thread -------------------------------------------------------
    def _receive(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        for polled in (socket, *self.guard.sockets):
            poller.register(polled, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                ready = dict(poller.poll(100))
                self.guard.handle(ready)
                if socket not in ready:
                    continue
                frames = socket.recv_multipart(copy=False)
                try:
                    self._store(frames)
                    socket.send(b"ok")
                except Exception as exc:  # a malformed message: refused, nothing kept
                    logger.warning("kv_transfer: refused a message from the producer: %s", exc)
                    socket.send(b"error: " + str(exc).encode()[:200])
        finally:
            socket.close()
            self.guard.close()

    def _store(self, frames) -> None:
        header = json.loads(bytes(frames[0].buffer))
        dtype, shape, hashes = DTYPES[header["dtype"]], tuple(header["shape"]), header["hashes"]
        transfers = header["transfer_ids"]
        if len(frames) != 3 or len(shape) != 5 or shape[0] != len(hashes) or len(transfers) != len(hashes):
            raise ValueError("expected a header, K and V of [blocks, layers, block_size, heads, head_dim] and a "
                             "transfer id per block")
        if not all(isinstance(t, str) and 0 < len(t) <= 128 for t in transfers):
            raise ValueError("a block without a transfer id: only blocks of a request in transfer are taken")
        layers, heads, head_dim, own_dtype = self.layout
        if shape[1:] != (layers, self.block_size, heads, head_dim) or dtype != own_dtype:
            raise ValueError(f"blocks of {list(shape[1:])} in {dtype}; this engine's are "
                             f"{[layers, self.block_size, heads, head_dim]} in {own_dtype}")
        keys = torch.frombuffer(bytearray(frames[1].buffer), dtype=dtype).view(shape)
        values = torch.frombuffer(bytearray(frames[2].buffer), dtype=dtype).view(shape)
        block_bytes = 2 * keys[0].numel() * keys.element_size()
        with self.lock:
            for i, key in enumerate(zip(transfers, (bytes.fromhex(h) for h in hashes))):
                if key in self.received:
                    self.received.move_to_end(key)
                    continue
                self.received[key] = (keys[i].clone(), values[i].clone())  # each freed on its own
                self.received_bytes += block_bytes
                self.counters.p2p_received_blocks += 1
            while self.received and self.received_bytes > self.config.buffer_bytes:
                self.received.popitem(last=False)
                self.received_bytes -= block_bytes

    # ---- consumer: scheduler side -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens, block_hashes):
        transfer = transfer_id_of(request)
        if not self.config.is_consumer or transfer is None:
            return 0  # only a request in transfer takes blocks, and only those sent for it
        with self.lock:  # the K/V themselves: the receiving thread may drop a hash from the buffer meanwhile
            found = stored_run(block_hashes, num_computed_tokens // self.block_size,
                               lambda block_hash: (transfer, block_hash) in self.received)
            for block_hash in found:
                self.received.move_to_end((transfer, block_hash))
            self.matched[request.request_id] = [self.received[(transfer, block_hash)] for block_hash in found]
        return len(found) * self.block_size

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        matched = self.matched.pop(request.request_id, [])[:num_external_tokens // self.block_size]
        self.pending_loads += [(block.block_id, keys, values) for block, (keys, values) in zip(blocks, matched)]
        self.counters.p2p_hit_tokens += len(matched) * self.block_size

    def build_connector_meta(self, filled):
        metadata = P2pMetadata(list(filled) if self.config.is_producer else [], self.pending_loads)
        self.pending_loads = []
        return metadata

    def reset_cache(self):
        with self.lock:
            self.received.clear()
            self.received_bytes = 0
        self.matched.clear()
        self.pending_loads = []

    def stats(self):
        with self.lock:
            self.counters.p2p_buffered_blocks = len(self.received)  # the gauge, read when the snapshot is taken
        return self.counters

    # ---- worker side --------------------------------------------------------------------------
    def start_load_kv(self, metadata: P2pMetadata) -> None:
        for block_id, keys, values in metadata.loads:
            for layer, (key_cache, value_cache) in enumerate(zip(self.kv_cache.key, self.kv_cache.value)):
                key_cache[block_id].copy_(keys[layer])
                value_cache[block_id].copy_(values[layer])

    def wait_for_save(self, metadata: P2pMetadata) -> None:
        sends = [block for block in metadata.sends if block.transfer_id is not None]  # nobody waits for the rest
        if not sends or time.monotonic() < self.send_again_at:
            return
        key_cache = self.kv_cache.key
        block_bytes = len(key_cache) * key_cache[0][0].numel() * key_cache[0].element_size()  # one side, every layer
        per_message = self.config.max_message_bytes // block_bytes
        if per_message == 0:
            logger.warning("kv_transfer: a block's K (%d bytes) is over max_message_bytes; blocks not sent",
                           block_bytes)
            return
        for start in range(0, len(sends), per_message):
            if not self._send_blocks(sends[start:start + per_message]):
                return

    def _send_blocks(self, blocks: list[FilledBlock]) -> bool:
        index = torch.tensor([block.block_id for block in blocks])
        keys = torch.stack([layer.index_select(0, index) for layer in self.kv_cache.key], dim=1).cpu()
        values = torch.stack([layer.index_select(0, index) for layer in self.kv_cache.value], dim=1).cpu()
        header = {"dtype": str(keys.dtype), "shape": list(keys.shape),
                  "hashes": [block.block_hash.hex() for block in blocks],
                  "transfer_ids": [block.transfer_id for block in blocks]}
        return self._send([json.dumps(header).encode(), _bytes(keys), _bytes(values)])

    def _send(self, frames: list) -> bool:
        if self.sender is None:
            self.sender = self.context.socket(zmq.REQ)
            self.sender.setsockopt(zmq.LINGER, 0)
            self.sender_monitor = secure_producer_socket(self.sender, self.secret)
            self.sender.connect(self.config.address)
        self.sender.send_multipart(frames, copy=False)
        if self.sender.poll(int(SEND_TIMEOUT_S * 1000)):
            answer = self.sender.recv()
            if answer == b"ok":
                return True
            logger.warning("kv_transfer: the consumer refused %d blocks: %s", len(frames), answer.decode()[:200])
        else:  # a REQ socket with no answer cannot send again: start over with a new one
            if handshake_failed(self.sender_monitor):
                logger.warning("kv_transfer: the peer at %s is not the consumer (it cannot prove it holds the "
                               "shared secret); no block was sent to it", self.config.address)
            else:
                logger.warning("kv_transfer: no answer from the consumer at %s in %.0f s; blocks not sent",
                               self.config.address, SEND_TIMEOUT_S)
            self._close_sender()
        self.send_failures += 1
        self.send_again_at = time.monotonic() + RETRY_AFTER_S
        return False

    def _close_sender(self) -> None:
        for socket in (self.sender, self.sender_monitor):
            if socket is not None:
                socket.close()
        self.sender = self.sender_monitor = None

    def shutdown(self) -> None:
        self.stopping.set()
        if self.receiver is not None:
            self.receiver.join(timeout=2)
        self._close_sender()
        self.context.term()


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as ZeroMQ sends them (bfloat16 has no numpy type: viewed as raw bytes)."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy())
