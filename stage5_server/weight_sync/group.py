"""The process group a trainer and the engine's workers share to move weights: trainer rank 0, then
every worker (rank ``rank_offset + worker rank``).

It is not the workers' own ``torch.distributed`` world (their TP/PP collectives, ``parallel/``): a
process has one default group, and the trainer is no part of the engine's. So each side builds a
stand-alone gloo group over its own ``TCPStore`` (the trainer hosts the store) and calls the group
object directly: ``broadcast`` from rank 0, each worker receiving every whole tensor and taking
its own shard (``loader.py``). On GPUs vLLM's example uses NCCL through a ``StatelessProcessGroup``
for the same reason; gloo keeps this runnable on a CPU.

vLLM: ``examples/offline_inference/rlhf_utils.py`` (``stateless_init_process_group``,
``WorkerExtension.init_weight_update_group`` / ``update_weight``), ``vllm/distributed/utils.py``
(``StatelessProcessGroup``).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_GROUP_TIMEOUT_S = 120.0


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> dist.ProcessGroup:
    """Join the group as ``rank`` of ``world_size`` (rank 0 hosts the store, at ``master_address:master_port``);
    returns once every rank has joined."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("stagedserve-weights", store), rank, world_size, timeout)


def broadcast_tensor(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Rank 0's ``tensor`` into every rank's (same shape and dtype); in place, on the CPU."""
    group.broadcast(tensor, 0).wait()


class WeightBroadcaster:
    """The trainer's side: ``WeightBroadcaster(address, port, world_size)`` (joins as rank 0), then
    ``send(named_tensors)`` while the engine runs ``update_weights_from_distributed`` with their metadata."""

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 timeout_s: float = DEFAULT_GROUP_TIMEOUT_S):
        self.group = init_weight_update_group(master_address, master_port, 0, world_size, timeout_s)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in named_tensors:
            broadcast_tensor(self.group, tensor.detach().to("cpu").contiguous())
