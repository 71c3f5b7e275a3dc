"""The process group a trainer and the engine's workers share to move weights: trainer rank 0, then
every worker (rank ``rank_offset + worker rank``).

It is not the workers' own ``torch.distributed`` world (their TP/PP collectives, ``parallel/``): a
process has one default group, and the trainer is no part of the engine's. So each side builds a
stand-alone gloo group and calls the group object directly: ``broadcast`` from rank 0, each worker
receiving every whole tensor and taking its own shard (``loader.py``). On GPUs vLLM's example uses
NCCL through a ``StatelessProcessGroup`` for the same reason; gloo keeps this runnable on a CPU.

The channel may cross hosts, so both ends prove who they are, with a secret they share
(``$STAGEDSERVE_WEIGHT_SYNC_SECRET``, or ``secret=``):

- the group forms through the trainer's ``StoreServer`` (``store.py``), which listens only on the address
  the trainer names and admits only peers that answer its challenge (and proves itself to them);
- gloo's own connections listen on one interface: the trainer's on its store address, a worker's on the
  interface it reaches the trainer through (never every interface);
- gloo's tensor traffic carries no proof of its own, so after each broadcast the trainer writes an HMAC of
  the tensor (its name, dtype, shape and bytes, and the round) to the authenticated store, and a worker
  loads nothing until every tensor it received matches: a tensor injected on the way fails the update,
  and the engine keeps its weights;
- each worker then writes a receipt to the store, and the trainer's ``send`` returns only once every
  worker's is in: a trainer that ends right after sending cuts off no worker still reading the HMACs.

A worker joins on a thread of its own (``join_in_background``): the engine core that asked it to join goes
on stepping other requests while the trainer's store is reached, and the update that needs the group
(``update_weights_from_distributed``) waits for the join, which fails after ``timeout_s``.

vLLM: ``examples/offline_inference/rlhf_utils.py`` (``stateless_init_process_group``,
``WorkerExtension.init_weight_update_group`` / ``update_weight``), ``vllm/distributed/utils.py``
(``StatelessProcessGroup``, over a ``TCPStore`` that trusts whoever reaches its port).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stage5_server.weight_sync.store import AuthenticatedStore, StoreServer, shared_secret

DEFAULT_GROUP_TIMEOUT_S = 120.0
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass
class WeightUpdateGroup:
    """One rank's membership: the gloo group, the authenticated store beside it, and the rounds so far."""

    group: dist.ProcessGroup
    store: AuthenticatedStore
    secret: bytes
    rounds: int = 0

    def tensor_mac(self, index: int, name: str, tensor: torch.Tensor) -> bytes:
        sha = hmac.new(self.secret, f"{self.rounds}/{index}/{name}/{tensor.dtype}/{list(tensor.shape)}".encode(),
                       hashlib.sha256)
        sha.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return sha.digest()

    def mac_key(self, index: int) -> str:
        return f"tensor-mac/{self.rounds}/{index}"

    def receipt_key(self, rank: int) -> str:
        return f"receipt/{self.rounds}/{rank}"


def _gloo_group(store: AuthenticatedStore, rank: int, world_size: int, timeout: timedelta,
                hostname: str) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    device = (dist.ProcessGroupGloo.create_default_device() if hostname in WILDCARDS
              else dist.ProcessGroupGloo.create_device(hostname=hostname))
    options._devices = [device]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore("stagedserve-weights", store), rank, world_size, options)


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                             secret: str | bytes | None = None) -> WeightUpdateGroup:
    """Join the group as ``rank`` (> 0) of ``world_size`` through the trainer's store at
    ``master_address:master_port``; returns once every rank has joined."""
    key = shared_secret(secret)
    timeout = timedelta(seconds=timeout_s)
    store = AuthenticatedStore(master_address, master_port, key, timeout)
    return WeightUpdateGroup(_gloo_group(store, rank, world_size, timeout, store.local_address), store, key)


def join_in_background(master_address: str, master_port: int, rank: int, world_size: int,
                       timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> concurrent.futures.Future:
    """``init_weight_update_group`` on a thread of its own: its future (the group, or why it did not form). The
    secret is read here, so a missing one fails at once."""
    key = shared_secret()
    future: concurrent.futures.Future = concurrent.futures.Future()

    def join() -> None:
        try:
            future.set_result(init_weight_update_group(master_address, master_port, rank, world_size, timeout_s, key))
        except BaseException as exc:  # noqa: BLE001 - the caller of result() gets it
            future.set_exception(exc)

    threading.Thread(target=join, name="weight-group-join", daemon=True).start()
    return future


def receive_tensors(member: WeightUpdateGroup, metadata: list[tuple[str, str, list[int]]],
                    dtype_of) -> list[tuple[str, torch.Tensor]]:
    """One broadcast per ``(name, dtype, shape)``, in order, each checked against the trainer's HMAC; a
    ValueError (nothing to load) if any tensor is not the trainer's."""
    received = []
    for name, dtype, shape in metadata:
        tensor = torch.empty(shape, dtype=dtype_of(dtype))
        member.group.broadcast(tensor, 0).wait()
        received.append((name, tensor))
    forged = next((name for index, (name, tensor) in enumerate(received)
                   if not hmac.compare_digest(member.store.get(member.mac_key(index)),
                                              member.tensor_mac(index, name, tensor))), None)
    # The receipt tells the trainer this rank has read the round's HMACs: until every rank's is in, it keeps
    # its store open (``WeightBroadcaster.send``).
    member.store.set(member.receipt_key(member.group.rank()), b"refused" if forged else b"loaded")
    member.rounds += 1
    if forged is not None:
        raise ValueError(f"update_weights_from_distributed: tensor {forged!r} does not match the trainer's HMAC "
                         "(changed on the way, or another sender); nothing was loaded")
    return received


class WeightBroadcaster:
    """The trainer's side: ``WeightBroadcaster(address, port, world_size)`` hosts the store on ``address`` (the
    loopback in the examples; a wildcard address only when given one) and joins as rank 0, once every worker
    has joined (``init_weight_update_group``); then ``send(named_tensors)`` while the engine runs
    ``update_weights_from_distributed`` with their metadata. The secret: ``secret`` or
    ``$STAGEDSERVE_WEIGHT_SYNC_SECRET``, the same as the engine's."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, secret: str | bytes | None = None):
        key = shared_secret(secret)
        self.server = StoreServer(master_address, master_port, key)
        try:
            own = "127.0.0.1" if master_address in WILDCARDS else master_address
            timeout = timedelta(seconds=timeout_s)
            store = AuthenticatedStore(own, self.server.address[1], key, timeout)
            self.member = WeightUpdateGroup(_gloo_group(store, 0, world_size, timeout, master_address), store, key)
        except BaseException:
            self.server.close()
            raise

    @property
    def group(self) -> dist.ProcessGroup:
        return self.member.group

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        member = self.member
        for index, (name, tensor) in enumerate(named_tensors):
            tensor = tensor.detach().to("cpu").contiguous()
            member.group.broadcast(tensor, 0).wait()
            member.store.set(member.mac_key(index), member.tensor_mac(index, name, tensor))
        # Wait for every worker's receipt: a trainer that closed its store now would cut off a worker still
        # reading the HMACs.
        receipts = [member.receipt_key(rank) for rank in range(1, member.group.size())]
        member.store.wait(receipts)
        refused = [rank for rank, key in enumerate(receipts, start=1) if member.store.get(key) != b"loaded"]
        member.rounds += 1
        if refused:
            raise RuntimeError(f"weight-update group: rank(s) {refused} refused the tensors (an HMAC did not match)")

    def close(self) -> None:
        self.server.close()
