"""The process groups of a split model: who the ranks are, how they meet, and how they talk.

Each worker joins one ``torch.distributed`` world (NCCL between GPUs, gloo between CPU
processes) of ``tensor_parallel_size x pipeline_parallel_size`` ranks. Rank ``r`` is tensor-parallel
rank ``r % TP`` of pipeline stage ``r // TP``; the TP ranks of one stage form a subgroup, and the
two collectives TP needs (``all_reduce``, ``all_gather``) run inside it. Pipeline stages talk point
to point: a rank sends its hidden states to the same TP rank of the next stage (``send_hidden``,
``recv_hidden``). The ranks meet through a ``FileStore`` in a private directory (no TCP port), and
the unauthenticated data connections stay on the loopback by default. Outside a process group (one
rank) ``all_reduce`` and ``all_gather`` return their input.

vLLM: ``vllm/distributed/parallel_state.py`` (``init_distributed_environment``,
``initialize_model_parallel``, ``get_tp_group``, ``get_pp_group``) and
``vllm/distributed/communication_op.py``.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.config import ModelConfig

logger = logging.getLogger("stagedserve")

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


def check_tensor_parallel_size(size, config: ModelConfig, device: torch.device, pipeline_parallel_size: int = 1) -> int:
    """``size`` if the model splits that many ways and the machine has the devices for ``size x
    pipeline_parallel_size`` ranks; else a ``ValueError``. On CUDA each rank needs its own GPU (``cuda:r``); on a
    CPU the ranks share the cores (more ranks than cores runs, slowly, and says so in the log)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: must be an integer >= 1, got {size!r}")
    ranks = size * pipeline_parallel_size
    if size > 1:
        tensor_parallel_shape(config, size)
    if ranks == 1:
        return size
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"device: {device} names one GPU, but {ranks} ranks use cuda:0..cuda:{ranks - 1}; "
                             "pass device='cuda' and choose GPUs with CUDA_VISIBLE_DEVICES")
        found = torch.cuda.device_count()
        if found < ranks:
            raise ValueError(f"tensor_parallel_size: {ranks} ranks need {ranks} GPUs, found {found}")
    elif device.type == "cpu":
        cores = os.cpu_count() or 1
        if cores < ranks:
            logger.warning("%d ranks share %d CPU cores: each runs one thread, and they take turns", ranks, cores)
    else:
        raise ValueError(f"tensor_parallel_size: device type {device.type!r} is not supported (cpu or cuda)")
    return size


def check_pipeline_parallel_size(size, config: ModelConfig) -> int:
    """``size`` if every pipeline stage gets at least one layer; else a ``ValueError``."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"pipeline_parallel_size: must be an integer >= 1, got {size!r}")
    if size > config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size: {size} stages need at least {size} layers; the model has "
                         f"{config.num_hidden_layers}")
    return size


def network_interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


HOST_IP_ENV = "VLLM_HOST_IP"  # vLLM's name for this host's address on the ranks' network


def interface_with_address(address: str) -> str:
    """The network interface that holds ``address`` on this host, or a ``ValueError``."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    raise ValueError(f"{HOST_IP_ENV}: no network interface of this host has the address {address!r}")


def resolve_interface(name: str | None) -> str:
    """The interface process-group traffic binds to: ``name``; else the one holding this host's
    ``VLLM_HOST_IP`` when that is set (each host sets its own); else the loopback one."""
    names = network_interfaces()
    if name is None and os.environ.get(HOST_IP_ENV):
        return interface_with_address(os.environ[HOST_IP_ENV])
    if name is None:
        loopback = [n for n in names if n.startswith("lo")]
        if not loopback:
            raise ValueError(f"distributed_interface: no loopback interface among {names}; name one explicitly")
        return loopback[0]
    if name not in names:
        raise ValueError(f"distributed_interface: no network interface {name!r} here; have {names}")
    return name


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the ``TP x PP`` grid."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_parallel_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and answers the engine: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tensor_parallel_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tensor_parallel_size


_TP_GROUP = None  # this rank's tensor-parallel subgroup; None: the whole world (or no group at all)


def init_model_parallel(place: RankPlace, store: str | dist.Store, interface: str, device: torch.device,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the world: rendezvous through ``store`` (the path of a file the ranks share, or a store
    object), traffic on ``interface``; then the TP subgroups (every rank creates every group, in the
    same order, as ``new_group`` requires)."""
    global _TP_GROUP
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ["NCCL_SOCKET_IFNAME"] = interface
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp, pp = place.tensor_parallel_size, place.pipeline_parallel_size
    meeting = {"init_method": f"file://{store}"} if isinstance(store, str) else {"store": store}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=place.rank, world_size=tp * pp,
                            timeout=timedelta(seconds=timeout_s), **meeting)
    if pp > 1 and tp > 1:
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == place.pp_rank:
                _TP_GROUP = group


def world_size() -> int:
    """Ranks in this rank's tensor-parallel group."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(_TP_GROUP)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks, in place; every rank gets the sum."""
    if world_size() > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's ``x`` along ``dim``, in rank order."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def send_hidden(hidden: torch.Tensor, dst: int) -> None:
    """Hand this stage's output to rank ``dst`` of the next stage (it knows the shape: it ran the same step)."""
    dist.send(hidden.contiguous(), dst)


def recv_hidden(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                src: int) -> torch.Tensor:
    """The previous stage's output for this step's ``num_tokens`` positions, from rank ``src``."""
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(hidden, src)
    return hidden
