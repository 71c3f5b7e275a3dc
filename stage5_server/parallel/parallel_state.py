"""The tensor-parallel group: who the ranks are, how they meet, and the two collectives TP needs.

Each worker joins one ``torch.distributed`` group (NCCL between GPUs, gloo between CPU
processes). The ranks meet through a ``FileStore`` in a private directory (no TCP port), and the
unauthenticated data connections stay on the loopback by default. Outside a process group (one
rank) ``all_reduce`` and ``all_gather`` return their input.

vLLM: ``vllm/distributed/parallel_state.py`` (``init_distributed_environment``,
``get_tp_group``) and ``vllm/distributed/communication_op.py``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.config import ModelConfig

DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer than this fails instead of hanging


@dataclass(frozen=True)
class TensorParallelShape:
    """How one rank's share of the model looks; identical on every rank except for the offsets."""

    world_size: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank (1 when the KV heads are replicated)
    kv_head_replicas: int  # how many ranks hold a copy of each KV head
    intermediate_size: int  # MLP columns per rank
    vocab_per_rank: int  # rows of the (padded) vocabulary per rank

    def kv_head_start(self, rank: int) -> int:
        """The first KV head rank ``rank`` holds."""
        return rank // self.kv_head_replicas * self.num_kv_heads


def tensor_parallel_shape(config: ModelConfig, world_size: int) -> TensorParallelShape:
    """Split ``config`` over ``world_size`` ranks, or a ``ValueError`` saying what does not divide. KV heads
    divide, or each is replicated on ``N / Hkv`` ranks (as vLLM's ``QKVParallelLinear``); the vocabulary is padded."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size: num_attention_heads={heads} is not divisible by "
                         f"tensor_parallel_size={world_size}")
    if kv_heads >= world_size and kv_heads % world_size:
        raise ValueError(f"tensor_parallel_size: num_key_value_heads={kv_heads} is not divisible by "
                         f"tensor_parallel_size={world_size}")
    if kv_heads < world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size: {world_size} is not a multiple of num_key_value_heads={kv_heads}, "
                         "so the KV heads cannot be replicated evenly across the ranks")
    if config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size: intermediate_size={config.intermediate_size} is not divisible by "
                         f"tensor_parallel_size={world_size}")
    return TensorParallelShape(
        world_size=world_size, num_heads=heads // world_size, num_kv_heads=max(1, kv_heads // world_size),
        kv_head_replicas=max(1, world_size // kv_heads), intermediate_size=config.intermediate_size // world_size,
        vocab_per_rank=-(-config.vocab_size // world_size))


def check_tensor_parallel_size(size, config: ModelConfig, device: torch.device) -> int:
    """``size`` if the model splits that many ways and the machine has the devices; else a ``ValueError``.
    On CUDA each rank needs its own GPU (``cuda:r``); on a CPU at least one core."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: must be an integer >= 1, got {size!r}")
    if size == 1:
        return size
    tensor_parallel_shape(config, size)
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"device: {device} names one GPU, but tensor_parallel_size={size} uses cuda:0.."
                             f"cuda:{size - 1}; pass device='cuda' and choose GPUs with CUDA_VISIBLE_DEVICES")
        found = torch.cuda.device_count()
        if found < size:
            raise ValueError(f"tensor_parallel_size: {size} ranks need {size} GPUs, found {found}")
    elif device.type == "cpu":
        cores = os.cpu_count() or 1
        if cores < size:
            raise ValueError(f"tensor_parallel_size: {size} CPU ranks need {size} cores, found {cores}")
    else:
        raise ValueError(f"tensor_parallel_size: device type {device.type!r} is not supported (cpu or cuda)")
    return size


def network_interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def resolve_interface(name: str | None) -> str:
    """The interface process-group traffic binds to: ``name``, or the loopback one."""
    names = network_interfaces()
    if name is None:
        loopback = [n for n in names if n.startswith("lo")]
        if not loopback:
            raise ValueError(f"distributed_interface: no loopback interface among {names}; name one explicitly")
        return loopback[0]
    if name not in names:
        raise ValueError(f"distributed_interface: no network interface {name!r} here; have {names}")
    return name


def init_tensor_parallel(rank: int, world_size: int, store_path: str, interface: str, device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group: rendezvous through the file at ``store_path``, traffic on ``interface``."""
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ["NCCL_SOCKET_IFNAME"] = interface
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; every rank gets the sum."""
    if world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
