"""What a worker does for weight updates and sleep: the methods ``collective_rpc`` reaches on every rank.

``WeightSyncWorker`` is a worker extension: with weight sync on, ``EngineConfig.worker_extension_cls`` names it
and every rank builds one over its worker (``executor/abstract.make_worker``), so each method runs on every
rank where that rank's worker lives (this process, a worker process, a Ray actor), and ``collective_rpc``
finds it by name beside the worker's own methods:

- ``update_weights(named_tensors)``: tensors by checkpoint name (``loader.py`` takes this rank's part);
- ``update_weights_from_path(path)``: every tensor of a checkpoint directory, read as the load does;
- ``init_weight_update_group`` / ``update_weights_from_distributed(metadata)``: join a trainer's gloo
  group (on a thread: the call returns at once) and receive each tensor it broadcasts, checked against
  the trainer's HMAC (``group.py``);
- ``sleep(level)``: drop the KV cache (level 1), and the weights too (level 2); ``wake_up`` (the
  engine core then re-allocates the KV cache by ``initialize_kv_cache``, as at start-up).

vLLM: ``Worker.sleep`` / ``wake_up`` in ``vllm/v1/worker/gpu_worker.py`` (over the ``CuMemAllocator``
of ``vllm/device_allocator/cumem.py``, which unmaps the pool's memory and maps it again),
``WorkerExtension`` in ``examples/offline_inference/rlhf_utils.py`` (which vLLM's ``worker_extension_cls`` loads by
name).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.weights import checkpoint_files
from stage5_server.weight_sync.group import DEFAULT_GROUP_TIMEOUT_S, join_in_background, receive_tensors
from stage5_server.weight_sync.loader import RankWeightLoader, tensor_dtype, weight_bytes


class WeightSyncWorker:
    """Beside a ``Worker`` (``worker.extension``); uses its ``config``, ``place``, ``rank``, ``device``, ``model``,
    ``kv_cache`` and ``model_runner``."""

    def __init__(self, worker: Any):
        self.worker = worker
        self._weight_loader: RankWeightLoader | None = None
        self._weight_group: Any = None

    @property
    def decoder(self) -> torch.nn.Module:
        """The rank's decoder (a pipeline stage wraps it)."""
        model = self.worker.model
        return getattr(model, "model", model)

    @property
    def weight_loader(self) -> RankWeightLoader:
        if self._weight_loader is None:
            self._weight_loader = RankWeightLoader(self.worker.config, self.worker.place, self.decoder)
        return self._weight_loader

    # ---- weights -------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load ``(checkpoint name, tensor)`` pairs; the number of tensors this rank took."""
        return len(self.weight_loader.load_weights(named_tensors))

    def update_weights_from_path(self, path: str) -> int:
        """Every tensor of the checkpoint directory ``path`` (same names and shapes as the served model's)."""
        files = checkpoint_files(Path(path))

        def tensors():
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        return self.update_weights(tensors())

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> int:
        """Start joining a trainer's group as rank ``rank_offset + this worker's rank`` and return that rank at
        once: the join runs on a thread (``group.py``), so the engine steps on meanwhile."""
        rank = rank_offset + self.worker.rank
        self._weight_group = join_in_background(master_address, master_port, rank, world_size, timeout_s)
        return rank

    def weight_update_group_ready(self) -> bool:
        """Whether the join has finished (a ValueError says why it failed)."""
        if self._weight_group is None:
            raise ValueError("update_weights_from_distributed: no weight-update group; call "
                             "init_weight_update_group first")
        if not self._weight_group.done():
            return False
        error = self._weight_group.exception()
        if error is not None:
            raise ValueError(f"update_weights_from_distributed: the weight-update group did not form: {error}")
        return True

    def update_weights_from_distributed(self, metadata: list[tuple[str, str, list[int]]]) -> int:
        """Receive one broadcast per ``(name, dtype, shape)``, in order, check each, then load them all."""
        self.weight_update_group_ready()
        member = self._weight_group.result()  # the join's own timeout bounds the wait
        return self.update_weights(receive_tensors(member, metadata, tensor_dtype))

    def destroy_weight_update_group(self) -> None:
        joining, self._weight_group = self._weight_group, None
        if joining is not None and joining.done() and joining.exception() is None:
            joining.result().store.close()

    def missing_weights(self) -> list[str]:
        """Parameters holding no weights (dropped by ``sleep(level=2)`` and not updated since)."""
        return self.weight_loader.missing()

    def weight_bytes(self) -> int:
        return weight_bytes(self.decoder)

    def kv_cache_bytes(self) -> int:
        cache = self.worker.kv_cache
        return 0 if cache is None else sum(t.numel() * t.element_size() for t in [*cache.key, *cache.value])

    # ---- sleep ---------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 1), and the weights (level 2); the bytes freed on this rank."""
        worker = self.worker
        freed = self.kv_cache_bytes()
        worker.model.set_attention_backend(None)  # nothing holds the blocks any more
        worker.kv_cache = worker.model_runner = None
        if level >= 2:
            freed += self.weight_loader.drop()
        gc.collect()
        if worker.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def wake_up(self) -> None:
        """Nothing to map back here: the core re-allocates the KV cache (``initialize_kv_cache``); weights
        dropped at level 2 come back with the next update."""
