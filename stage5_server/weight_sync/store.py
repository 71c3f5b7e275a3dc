"""The key-value store a trainer and the engine's workers meet at, which admits only holders of a shared secret.

A ``torch.distributed`` group forms through a store: each rank writes where it listens, reads where the others
do, and counts who has arrived. torch's ``TCPStore`` listens on every interface (``[::]``) whatever host it
is given and answers anyone who connects: a stranger can read and write its keys, and so learn where every
rank listens, or join in a rank's place. This store is one a trainer hosts instead:

- **Where it listens**: exactly the address it is given (``127.0.0.1`` in the examples), never every interface
  unless that address is ``0.0.0.0`` or ``::``.
- **Who may talk to it**: each connection starts with a challenge both ways. The server sends a fresh nonce;
  the client answers with its own nonce and ``HMAC(secret, "client" | both nonces)``; the server checks it and
  answers with ``HMAC(secret, "server" | both nonces)``, which the client checks. A peer without the secret is
  refused, and the refusal is logged with its address; a worker never talks to a store that cannot prove it
  holds the secret (one that took the port first, say). The secret itself never crosses the wire.
- **Every message after that** carries an HMAC under a session key drawn from both nonces, over its direction,
  its sequence number and its bytes: a message changed, replayed or injected on the way ends the connection.
  A message is at most ``MAX_FRAME_BYTES``; the values are msgpack, never pickle.

``StoreServer`` is the trainer's listening side; ``AuthenticatedStore`` is a ``torch.distributed.Store`` (a
Python subclass, as torch allows) that every rank, the trainer's included, hands to ``ProcessGroupGloo``.

Compared with: torch's ``TCPStore`` (``torch/csrc/distributed/c10d/TCPStore.cpp``: no authentication) and vLLM's
``StatelessProcessGroup`` (``vllm/distributed/utils.py``), which builds the same group over a ``TCPStore`` and so
trusts whoever reaches the port.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import msgspec
import torch.distributed as dist

logger = logging.getLogger("stagedserve")

SECRET_ENV = "STAGEDSERVE_WEIGHT_SYNC_SECRET"
MIN_SECRET_CHARS = 32
MAGIC = b"stagedserve-weight-store-1"
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_FRAME_BYTES = 1 << 20  # a rank's address, a counter, a tensor's MAC: nothing near this
HANDSHAKE_TIMEOUT_S = 5.0


def shared_secret(secret: str | bytes | None = None) -> bytes:
    """The secret the trainer and the workers share: ``secret``, else ``$STAGEDSERVE_WEIGHT_SYNC_SECRET``."""
    value = secret if secret is not None else os.environ.get(SECRET_ENV, "")
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"weight-update group: a shared secret of at least {MIN_SECRET_CHARS} characters is needed; "
                         f"set {SECRET_ENV} to the same value in the trainer's and the engine's environment "
                         f"(e.g. $(openssl rand -hex 32))")
    return value.encode() if isinstance(value, str) else bytes(value)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class Channel:
    """Length-prefixed msgpack messages, each with an HMAC over (direction, sequence number, bytes)."""

    def __init__(self, sock: socket.socket, session_key: bytes, sending: bytes, receiving: bytes):
        self.sock, self.key = sock, session_key
        self.sending, self.receiving = sending, receiving
        self.sent = self.received = 0

    def send(self, message: Any) -> None:
        payload = msgspec.msgpack.encode(message)
        mac = _mac(self.key, self.sending, str(self.sent).encode(), payload)
        self.sent += 1
        self.sock.sendall(struct.pack("<I", len(payload)) + payload + mac)

    def recv(self) -> Any:
        (size,) = struct.unpack("<I", _recv_exactly(self.sock, 4))
        if size > MAX_FRAME_BYTES:
            raise PermissionError(f"a message of {size} bytes (at most {MAX_FRAME_BYTES})")
        payload, mac = _recv_exactly(self.sock, size), _recv_exactly(self.sock, MAC_BYTES)
        if not hmac.compare_digest(mac, _mac(self.key, self.receiving, str(self.received).encode(), payload)):
            raise PermissionError("a message whose HMAC does not match (changed, replayed or not from the peer)")
        self.received += 1
        return msgspec.msgpack.decode(payload)


def server_handshake(sock: socket.socket, secret: bytes) -> Channel:
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + nonce)
    answer = _recv_exactly(sock, NONCE_BYTES + MAC_BYTES)
    peer_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", nonce, peer_nonce)):
        raise PermissionError("it does not hold the shared secret")
    sock.sendall(_mac(secret, b"server", nonce, peer_nonce))
    return Channel(sock, _mac(secret, b"session", nonce, peer_nonce), b"s", b"c")


def client_handshake(sock: socket.socket, secret: bytes, where: str) -> Channel:
    greeting = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if not greeting.startswith(MAGIC):
        raise PermissionError(f"weight-update group: {where} is not a weight-update store")
    nonce, own = greeting[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    sock.sendall(own + _mac(secret, b"client", nonce, own))
    if not hmac.compare_digest(_recv_exactly(sock, MAC_BYTES), _mac(secret, b"server", nonce, own)):
        raise PermissionError(f"weight-update group: the store at {where} did not prove it holds the shared secret")
    return Channel(sock, _mac(secret, b"session", nonce, own), b"c", b"s")


class StoreServer:
    """The trainer's store: listens on ``(host, port)`` exactly, serves each authenticated peer on a thread."""

    def __init__(self, host: str, port: int, secret: bytes):
        self.secret = secret
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=128)
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()
        self.closed = False
        self.refused = 0  # peers turned away: no secret, or a bad message
        threading.Thread(target=self._accept, name="weight-store", daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()[:2]

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), name="weight-store-peer", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        with conn:
            try:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                channel = server_handshake(conn, self.secret)
                conn.settimeout(None)
            except (OSError, PermissionError) as exc:
                self._refuse(peer, exc)
                return
            try:
                while not self.closed:
                    op, *args = channel.recv()
                    channel.send(self._handle(op, args))
            except PermissionError as exc:
                self._refuse(peer, exc)
            except (OSError, ConnectionError, ValueError, TypeError, msgspec.DecodeError):
                pass  # the peer left, or sent what no client of this module sends

    def _refuse(self, peer: tuple, why: Exception) -> None:
        self.refused += 1
        logger.warning("weight-update store at %s:%s refused a peer from %s:%s: %s", *self.address, *peer[:2], why)

    def _handle(self, op: str, args: list) -> list:
        with self.changed:
            if op == "set":
                self.data[args[0]] = bytes(args[1])
                self.changed.notify_all()
                return ["ok"]
            if op in ("get", "wait"):
                keys, timeout_s = ([args[0]] if op == "get" else list(args[0])), args[1]
                if not self.changed.wait_for(lambda: all(k in self.data for k in keys), timeout_s):
                    return ["timeout", f"keys {keys} not set within {timeout_s} s"]
                return ["ok", self.data[keys[0]] if op == "get" else b""]
            if op == "add":
                value = int(self.data.get(args[0], b"0")) + int(args[1])
                self.data[args[0]] = str(value).encode()
                self.changed.notify_all()
                return ["ok", value]
            if op == "check":
                return ["ok", all(k in self.data for k in args[0])]
            if op == "compare_set":
                key, expected, desired = args[0], bytes(args[1]), bytes(args[2])
                current = self.data.get(key)
                if (current is None and not expected) or current == expected:
                    self.data[key] = current = desired
                    self.changed.notify_all()
                return ["ok", expected if current is None else current]
            if op == "delete_key":
                return ["ok", self.data.pop(args[0], None) is not None]
            if op == "num_keys":
                return ["ok", len(self.data)]
        return ["error", f"unknown store operation {op!r}"]

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        with self.changed:
            self.changed.notify_all()


class AuthenticatedStore(dist.Store):
    """A client of ``StoreServer``, as ``ProcessGroupGloo`` takes a store. Connecting retries until ``timeout``
    (the trainer may start after the engine); a store that cannot prove the secret is never used."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: timedelta):
        super().__init__()
        self._timeout = timeout
        self._lock = threading.Lock()
        where = f"{host}:{port}"
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"weight-update group: no store answered at {where} within "
                                       f"{timeout.total_seconds():.0f} s ({exc})") from None
                time.sleep(0.1)
        try:
            self._channel = client_handshake(sock, secret, where)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise PermissionError(f"weight-update group: the store at {where} broke off the handshake ({exc}); "
                                  "does it hold the same secret?") from None
        except PermissionError:
            sock.close()
            raise
        sock.settimeout(None)
        self._sock = sock
        self.local_address = sock.getsockname()[0]  # the interface that reaches the trainer

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            self._channel.send([op, *args])
            status, *value = self._channel.recv()
        if status == "timeout":
            raise TimeoutError(f"weight-update group: {value[0]}")
        if status != "ok":
            raise RuntimeError(f"weight-update group: {value[0]}")
        return value[0] if value else None

    def _timeout_s(self, timeout: timedelta | None = None) -> float:
        return (timeout or self._timeout).total_seconds()

    # ---- torch.distributed.Store ----------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._timeout_s())

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", list(keys), self._timeout_s(timeout))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        as_bytes = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return self._call("compare_set", key, *as_bytes)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def close(self) -> None:
        self._sock.close()
