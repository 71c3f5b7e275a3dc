"""The engine core's side: each weight update and sleep runs between two steps, the prefix cache is
reset, and the weight version counts the updates.

``WeightSync`` is a member of the ``EngineCore`` (``core.weight_sync``), attached by the builder when the
engine runs with ``enable_weight_sync=True``. It registers its calls among the core's *utilities*
(``core/utilities.py``), which reaches them two ways: directly (the offline ``LLM``, whose caller drives the
steps), or as a ``UtilityCall`` message through the core's busy loop (the server's engine thread or
engine-core process), which runs them between steps; and it adds the admission check that refuses a new
request while the engine sleeps.

Consistency, as this engine keeps it:

- no step runs half-old, half-new weights: an update runs between steps, on every rank, before
  the next step is scheduled;
- no request mixes weights: an update (or a sleep) *drains* first. The requests already in the
  core run to the end on the old weights; requests arriving meanwhile are held, and admitted on
  the new weights once the update is done (vLLM's ``pause_generation(mode="wait")``). The offline
  ``LLM`` refuses an update while requests it was given are unfinished;
- no KV computed by old weights is reused: the prefix cache is reset (stage 4's
  ``reset_prefix_cache``) after every update and at every sleep;
- ``version`` counts the updates; it rides in every stats snapshot (``/metrics``
  ``stagedserve:weight_version``) and in each response's ``system_fingerprint``.

vLLM: ``EngineCore.sleep``, ``wake_up``, ``is_sleeping`` in ``vllm/v1/engine/core.py``; ``LLM.sleep`` in
``vllm/entrypoints/llm.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from shared.weights import checkpoint_files
from stage5_server.errors import EngineSleepingError
from stage5_server.weight_sync.loader import describe_tensors

# Utilities that wait for the requests in the core to finish (and hold new ones) before they run.
DRAINING = frozenset({"update_weights", "update_weights_from_path", "update_weights_from_distributed",
                      "reload_weights", "sleep"})
UTILITIES = DRAINING | {"wake_up", "is_sleeping", "weight_version", "refusal"}
# Worker methods whose state the core keeps: refused through the public collective_rpc. A weight method by name
# would swap the weights without the drain, the prefix-cache reset and the version bump of the core's own call.
CORE_ONLY = {"sleep": "LLM.sleep", "wake_up": "LLM.wake_up", "initialize_kv_cache": "LLM.wake_up",
             "update_weights": "LLM.update_weights or POST /update_weights",
             "update_weights_from_path": "LLM.update_weights_from_path or POST /update_weights {\"path\"}",
             "update_weights_from_distributed":
                 "LLM.update_weights_from_distributed or POST /update_weights {\"tensors\"}"}
UNREADABLE_CHECKPOINT = ("update_weights_from_path: not a checkpoint directory this server can read (a directory of "
                         "*.safetensors files, or an index and its shards)")


def readable_checkpoint(path: str) -> None:
    """``path`` names a checkpoint directory whose weight files this process can open; ``UNREADABLE_CHECKPOINT``
    otherwise."""
    try:
        if not isinstance(path, str) or not path.strip():
            raise ValueError("empty")
        for file in checkpoint_files(Path(path)):
            with open(file, "rb") as weights:
                weights.read(8)
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(UNREADABLE_CHECKPOINT) from None


class WeightSync:
    def __init__(self, core: Any):  # the EngineCore (core/engine_core.py), which holds this as ``weight_sync``
        self.core = core
        self.version = 0  # weight updates done
        self.sleep_level = 0  # 0: awake
        self.weights_missing = False  # a level-2 sleep dropped them: no request runs until every one is loaded again
        utilities = core.utilities
        for name in sorted(UTILITIES):
            utilities.register(name, getattr(self, name), drains=name in DRAINING)
        utilities.core_only.update(CORE_ONLY)
        core.admission_checks.append(self.refusal)

    def _rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.core.utilities.rpc(method, args, kwargs)

    # ---- weight updates ------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Tensors by checkpoint name, into every rank; the new weight version."""
        tensors = list(named_tensors)
        return self._updated(self._rpc("update_weights", (tensors,)))

    def update_weights_from_path(self, path: str) -> int:
        """Every tensor of the checkpoint directory ``path``. A path this process cannot read, for whatever reason
        (missing, not a directory, no weights, no permission, too long), is one ValueError that does not say
        which: a caller learns nothing about the server's files from it."""
        readable_checkpoint(path)
        return self._updated(self._rpc("update_weights_from_path", (str(path),)))

    def reload_weights(self) -> int:
        """The served model's own checkpoint again (after ``sleep(level=2)``, say)."""
        return self.update_weights_from_path(str(self.core.config.model_path))

    def update_weights_from_distributed(self, metadata: list) -> int:
        """One broadcast per ``(name, dtype, shape)`` from a trainer's group (``group.py``), into every rank."""
        return self._updated(self._rpc("update_weights_from_distributed", ([tuple(m) for m in metadata],)))

    def _updated(self, counts: list[int]) -> int:
        if sum(counts) == 0:
            raise ValueError("update_weights: no tensor of the update has a place in the served model")
        self.version += 1
        if self.weights_missing:
            missing = [name for names in self._rpc("missing_weights") for name in names]
            self.weights_missing = bool(missing)
        self._reset_prefix_cache("update_weights")
        return self.version

    # ---- sleep ---------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (1), and the weights too (2); bytes freed over the ranks."""
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")
        if self.sleep_level:
            return 0
        self._reset_prefix_cache("sleep")  # the blocks' contents are gone: nothing may hit them after waking
        freed = sum(self._rpc("sleep", (level,)))
        self.sleep_level = level
        if level >= 2:  # until an update (asleep or awake) brings every weight back
            self.weights_missing = True
        return freed

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Allocate the KV cache again; after level 2 the weights come back with the next update
        (``update_weights*``, or ``reload_weights`` for the served checkpoint). Whether it was asleep."""
        unknown = set(tags or []) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        if not self.sleep_level:
            return False
        self._rpc("wake_up")
        config = self.core.config
        self._rpc("initialize_kv_cache", (self.core.num_kv_blocks, config.cache.block_size,
                                                    self.core.max_model_len))
        self.sleep_level = 0
        return True

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    def weight_version(self) -> int:
        return self.version

    def _reset_prefix_cache(self, what: str) -> None:
        if not self.core.reset_prefix_cache():  # only refused while requests hold blocks: drained, they do not
            raise RuntimeError(f"{what}: the prefix cache could not be reset (requests hold blocks)")

    # ---- admission -----------------------------------------------------------------------------------
    def refusal(self) -> str | None:
        """Why no request may run now, or None."""
        if self.sleep_level:
            return f"The engine is sleeping (level {self.sleep_level}); POST /wake_up (LLM.wake_up()) first."
        if self.weights_missing:
            return ("The engine woke from a level-2 sleep and holds no weights; update them "
                    "(update_weights, or reload_weights for the served checkpoint) first.")
        return None


__all__ = ["DRAINING", "EngineSleepingError", "UNREADABLE_CHECKPOINT", "UTILITIES", "WeightSync", "describe_tensors"]
