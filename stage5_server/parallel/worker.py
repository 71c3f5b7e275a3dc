"""One tensor-parallel rank: its process, its shard of the model, its share of the KV cache.

A worker joins the process group, loads its shard and serves the engine over a pipe
(``init_kv_cache``, ``profile_kv_memory``, ``execute_model``) until told to stop or the pipe
closes. Only rank 0 sends back the step's logits, so sampling happens once, in the engine.

vLLM: ``vllm/v1/worker/gpu_worker.py`` and ``WorkerProc`` in ``vllm/v1/executor/multiproc_executor.py``.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stage2_paged.attention import build_paged_metadata
from stage2_paged.kv_cache import PagedKVCache
from stage5_server.attention import ATTENTION_BACKENDS
from stage5_server.attention.memory import profile_free_kv_memory
from stage5_server.engine.processes import set_process_name
from stage5_server.model import fuse_projections
from stage5_server.parallel.parallel_state import init_tensor_parallel, tensor_parallel_shape
from stage5_server.parallel.sharded_model import load_sharded_model


@dataclass
class StepBatch:
    """One step's prepared inputs, as plain lists: what every rank needs to run its forward pass."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]  # the token rows whose logits are sampled


@dataclass
class WorkerSettings:
    model_path: str
    world_size: int
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda"
    interface: str
    store_path: str
    timeout_s: float


class Worker:
    def __init__(self, rank: int, settings: WorkerSettings):
        self.rank = rank
        self.device = torch.device("cuda", rank) if settings.device_type == "cuda" else torch.device("cpu")
        self.dtype = settings.dtype
        model, self.config = load_sharded_model(settings.model_path, rank, settings.world_size, settings.dtype,
                                                self.device)
        self.model = fuse_projections(model)  # this rank's q/k/v (gate/up) shards fused: its slice of the fused GEMM
        self.shape = tensor_parallel_shape(self.config, settings.world_size)
        self.kv_cache: PagedKVCache | None = None

    def describe(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device),
                "num_heads": self.shape.num_heads, "num_kv_heads": self.shape.num_kv_heads}

    def profile_kv_memory(self, num_tokens: int, utilization: float) -> int:
        return profile_free_kv_memory(self.model, self.device, num_tokens, utilization)

    def init_kv_cache(self, num_blocks: int, block_size: int, attention_backend: str) -> None:
        self.kv_cache = PagedKVCache(num_blocks, block_size, self.config.num_hidden_layers, self.shape.num_kv_heads,
                                     self.config.head_dim, self.dtype, self.device)
        self.model.set_attention_backend(ATTENTION_BACKENDS[attention_backend](self.kv_cache))

    def execute_model(self, step: StepBatch) -> torch.Tensor | None:
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        meta = build_paged_metadata(step.slot_mapping, step.query_start_loc, step.seq_lens, step.block_tables,
                                    self.device)
        hidden = self.model(as_long(step.input_ids), as_long(step.positions), meta)
        if not step.logits_indices:
            return None
        logits = self.model.compute_logits(hidden[as_long(step.logits_indices)])  # gathered on every rank
        return logits.cpu() if self.rank == 0 else None


def worker_main(rank: int, settings: WorkerSettings, conn) -> None:
    """A worker's life: answer ``(method, args)`` with ``("ok", result)`` or ``("error", tb)``; exit after an error."""
    set_process_name(f"ss-tp-{rank}")
    try:
        device = torch.device("cuda", rank) if settings.device_type == "cuda" else torch.device("cpu")
        if device.type == "cpu":  # the ranks share the cores instead of each claiming all of them
            threads = os.environ.get("OMP_NUM_THREADS")
            torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // settings.world_size))
        init_tensor_parallel(rank, settings.world_size, settings.store_path, settings.interface, device,
                             settings.timeout_s)
        worker = Worker(rank, settings)
        conn.send(("ok", worker.describe()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the engine process is gone: nobody to serve
                break
            if method == "shutdown":
                break
            try:
                result = getattr(worker, method)(*args)
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                break
            conn.send(("ok", result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
