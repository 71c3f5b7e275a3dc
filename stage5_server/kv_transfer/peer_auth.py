"""Who is on the other end of the prefill/decode channel: ZeroMQ's CURVE, with keys drawn from a shared secret.

A prompt's K/V is the prompt, and a block the consumer takes in is served as the cache of whoever's request
hashes to it. So the channel proves both ends, with one secret the operator gives both instances
(``$STAGEDSERVE_KV_TRANSFER_SECRET``, at least 32 characters):

- from the secret each side derives a CURVE key pair, one for the consumer and one for the producer
  (``HMAC-SHA256(secret, role)`` as the secret key);
- the consumer's socket is a CURVE server: the handshake proves it holds the consumer's secret key, so a
  process that took the consumer's port first, without the secret, completes no handshake and receives no
  byte of K/V (the producer logs it and sends nothing);
- the consumer admits only the producer's public key, through a ZAP handler (ZeroMQ's authentication hook):
  any other peer is refused and logged with its address, and one that does not speak CURVE fails the
  handshake and is logged too;
- every message after the handshake is encrypted and authenticated by CURVE itself.

vLLM's P2P NCCL connector (``vllm/distributed/kv_transfer/kv_connector/v1/p2p/p2p_nccl_engine.py``) opens
plain ZeroMQ sockets and accepts tensors from whoever connects; the ZAP and CURVE mechanisms used here are
libzmq's (``zmq_curve``, ``zmq_zap``), which pyzmq's ``zmq.auth`` also wraps.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger("stagedserve")

SECRET_ENV = "STAGEDSERVE_KV_TRANSFER_SECRET"
MIN_SECRET_CHARS = 32
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's authentication handler
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def kv_transfer_secret() -> bytes:
    """The secret both instances share, from the environment (never from a flag: flags show in ``ps``)."""
    value = os.environ.get(SECRET_ENV, "")
    if not zmq.has("curve"):
        raise RuntimeError("kv_transfer_config: P2pZmqConnector needs ZeroMQ with CURVE (pyzmq's own wheels have it)")
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"kv_transfer_config: P2pZmqConnector needs a shared secret of at least {MIN_SECRET_CHARS} "
                         f"characters in {SECRET_ENV}, the same on the prefill and the decode instance "
                         "(e.g. $(openssl rand -hex 32))")
    return value.encode()


def curve_keys(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` CURVE keys of ``role`` ("consumer" or "producer"), Z85-encoded, from the secret."""
    seed = hmac.new(secret, f"stagedserve-kv-transfer/{role}".encode(), hashlib.sha256).digest()
    secret_key = z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


class ConsumerGuard:
    """The consumer's side: makes ``socket`` a CURVE server that admits only the producer, and reports every peer
    it turns away. ``sockets`` are what the receiving thread polls; ``handle`` answers what is ready there."""

    def __init__(self, context: zmq.Context, socket: zmq.Socket, secret: bytes):
        public, secret_key = curve_keys(secret, "consumer")
        self.producer_key = z85.decode(curve_keys(secret, "producer")[0])
        self.zap = context.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)  # before the first handshake: libzmq asks this socket about each peer
        socket.curve_server = True
        socket.curve_secretkey, socket.curve_publickey = secret_key, public
        socket.zap_domain = b"stagedserve-kv-transfer"
        self.monitor = socket.get_monitor_socket(HANDSHAKE_FAILURES)
        self.refused = 0

    @property
    def sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        return self.zap, self.monitor

    def handle(self, ready: dict) -> None:
        if self.zap in ready:
            self._answer_zap()
        if self.monitor in ready:
            event = recv_monitor_message(self.monitor)
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # a refused key was logged by the ZAP answer
                self.refused += 1
                logger.warning("kv_transfer: refused a peer at %s: its handshake failed (it does not speak CURVE "
                               "with this channel's keys; no shared secret)", event["endpoint"].decode())

    def _answer_zap(self) -> None:
        version, request_id, _domain, address, _identity, mechanism, *credentials = self.zap.recv_multipart()
        allowed = mechanism == b"CURVE" and credentials[:1] == [self.producer_key]
        if not allowed:
            self.refused += 1
            logger.warning("kv_transfer: refused a peer from %s: it is not the producer (its key is not the one "
                           "the shared secret gives)", address.decode(errors="replace"))
        status = (b"200", b"OK") if allowed else (b"400", b"not the producer")
        self.zap.send_multipart([version, request_id, *status, b"", b""])

    def close(self) -> None:
        self.monitor.close()
        self.zap.close()


def secure_producer_socket(socket: zmq.Socket, secret: bytes) -> zmq.Socket:
    """``socket`` as a CURVE client that talks only to the holder of the consumer's key; and its monitor, whose
    handshake failures say the peer at the address is not the consumer."""
    public, secret_key = curve_keys(secret, "producer")
    socket.curve_secretkey, socket.curve_publickey = secret_key, public
    socket.curve_serverkey = curve_keys(secret, "consumer")[0]
    return socket.get_monitor_socket(HANDSHAKE_FAILURES)


def handshake_failed(monitor: zmq.Socket) -> bool:
    """Whether the producer's monitor saw a failed handshake since last asked (the events are consumed)."""
    failed = False
    while monitor.poll(0):
        recv_monitor_message(monitor)
        failed = True
    return failed
