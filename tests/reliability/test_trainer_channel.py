"""The trainer's weight-update channel probed from outside: a real trainer process (``WeightBroadcaster``) hosts the
group's store, and strangers try it. It listens on the loopback it was given and nowhere else; a stranger with
torch's own ``TCPStore`` client, or with this module's client and the wrong secret, reads and writes nothing and
is logged as refused; a worker with the secret joins and receives the trainer's tensor. A tensor whose bytes do
not match the trainer's HMAC is refused before anything is loaded; a store that took the port without the secret
cannot pass for the trainer.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from stage5_server.weight_sync.group import WeightBroadcaster, init_weight_update_group, receive_tensors
from stage5_server.weight_sync.store import AuthenticatedStore
from tests.reliability.served import is_loopback, listening_sockets
from tests.stage5.server_fixtures import REPO, wait_until

SECRET = secrets.token_hex(32)
TRAINER = """
import torch
from stage5_server.weight_sync import WeightBroadcaster
sender = WeightBroadcaster("127.0.0.1", {port}, 2, timeout_s=60)
print("joined", flush=True)
sender.send([("model.norm.weight", torch.arange(6.0).reshape(2, 3))])
print("sent", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def trainer():
    """A trainer process waiting for one worker (world size 2), its port, and its output once it ends."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", TRAINER.format(port=port)], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(REPO), "STAGEDSERVE_WEIGHT_SYNC_SECRET": SECRET})
    proc = psutil.Process(process.pid)
    assert wait_until(lambda: any(s[3] == port for s in listening_sockets([proc])) or process.poll() is not None,
                      timeout=60), "the trainer never listened"
    try:
        yield process, port, proc
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_the_trainers_store_listens_on_the_loopback_only_and_refuses_strangers_until_a_worker_joins(trainer):
    process, port, proc = trainer
    sockets = listening_sockets([proc])
    assert sockets and all(is_loopback(address) for _, _, address, _, _ in sockets), sockets

    # A stranger with torch's own TCPStore client: it reads and writes nothing.
    with pytest.raises(Exception):  # noqa: B017 - whichever way torch reports it, nothing was read or written
        stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=8),
                                 wait_for_workers=False)
        stranger.set("stagedserve-weights/injected", "1")
        stranger.get("stagedserve-weights/0")
    # A stranger speaking this store's protocol with another secret: refused at the challenge.
    with pytest.raises(PermissionError):
        AuthenticatedStore("127.0.0.1", port, secrets.token_hex(32).encode(), timedelta(seconds=10))

    # The worker with the secret joins, and the trainer's tensor arrives checked.
    member = init_weight_update_group("127.0.0.1", port, 1, 2, timeout_s=60, secret=SECRET)
    received = receive_tensors(member, [("model.norm.weight", "float32", [2, 3])], lambda name: getattr(torch, name))
    assert torch.equal(received[0][1], torch.arange(6.0).reshape(2, 3))
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert output.count("refused a peer") >= 2, output  # both strangers, logged with their address
    assert "sent" in output


def test_a_tensor_that_is_not_the_trainers_is_refused_before_anything_is_loaded():
    port = free_port()
    joined = {}
    worker = threading.Thread(target=lambda: joined.update(member=init_weight_update_group(
        "127.0.0.1", port, 1, 2, timeout_s=30, secret=SECRET)), daemon=True)
    worker.start()
    sender = WeightBroadcaster("127.0.0.1", port, 2, timeout_s=30, secret=SECRET)
    worker.join(30)
    try:
        sent, injected = torch.ones(4), torch.full((4,), 7.0)  # what the trainer meant, what arrived instead
        results = {}
        receiver = threading.Thread(target=lambda: results.update(outcome=_receive(joined["member"])), daemon=True)
        receiver.start()
        member = sender.member
        member.group.broadcast(injected, 0).wait()
        member.store.set(member.mac_key(0), member.tensor_mac(0, "model.norm.weight", sent))
        member.rounds += 1
        receiver.join(30)
        assert isinstance(results["outcome"], ValueError) and "HMAC" in str(results["outcome"]), results
    finally:
        sender.close()


def _receive(member):
    try:
        return receive_tensors(member, [("model.norm.weight", "float32", [4])], lambda name: getattr(torch, name))
    except ValueError as exc:
        return exc


def test_a_store_that_took_the_port_without_the_secret_cannot_pass_for_the_trainer():
    """An impostor that took the port first and waves every client through: the worker refuses it, so it can
    neither feed the worker weights nor learn the group's addresses."""
    from stage5_server.weight_sync.store import MAC_BYTES, MAGIC, NONCE_BYTES

    impostor = socket.create_server(("127.0.0.1", 0))

    def wave_through() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(MAGIC + secrets.token_bytes(NONCE_BYTES))
            conn.recv(NONCE_BYTES + MAC_BYTES)
            conn.sendall(secrets.token_bytes(MAC_BYTES))  # a proof it cannot compute
            conn.recv(1)

    threading.Thread(target=wave_through, daemon=True).start()
    try:
        with pytest.raises(PermissionError, match="did not prove it holds the shared secret"):
            AuthenticatedStore("127.0.0.1", impostor.getsockname()[1], SECRET.encode(), timedelta(seconds=10))
    finally:
        impostor.close()


def test_without_a_secret_neither_side_starts(monkeypatch):
    monkeypatch.delenv("STAGEDSERVE_WEIGHT_SYNC_SECRET", raising=False)
    with pytest.raises(ValueError, match="STAGEDSERVE_WEIGHT_SYNC_SECRET"):
        WeightBroadcaster("127.0.0.1", free_port(), 2, timeout_s=1)
    with pytest.raises(ValueError, match="STAGEDSERVE_WEIGHT_SYNC_SECRET"):
        init_weight_update_group("127.0.0.1", free_port(), 1, 2, timeout_s=1)



def test_a_trainer_that_exits_right_after_sending_cuts_off_no_slow_worker(trainer):
    """``send`` returns once every worker has read the round's HMACs: a worker slow to read them (held up here
    by a second) still gets its tensor, though the trainer process ends as soon as ``send`` returns."""
    process, port, _ = trainer
    member = init_weight_update_group("127.0.0.1", port, 1, 2, timeout_s=60, secret=SECRET)
    read_hmac = member.store.get

    def slow_get(key):
        threading.Event().wait(1.0)
        return read_hmac(key)

    member.store.get = slow_get
    received = receive_tensors(member, [("model.norm.weight", "float32", [2, 3])], lambda name: getattr(torch, name))
    assert torch.equal(received[0][1], torch.arange(6.0).reshape(2, 3))
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and "sent" in output, output
