"""Serving a model while it trains: weight updates, sleep and wake.

RL post-training (TRL's GRPO, OpenRLHF, verl) generates rollouts with the engine, trains on them in
another process, pushes the new weights into the engine and generates again. This room gives the
engine what that loop needs when it runs with ``enable_weight_sync=True`` (``--enable-weight-sync``):
three members, one for each of the core, the front end and every worker, and nothing else. Off, nothing
of this room is imported or called:

- ``worker.py``: the worker extension every rank holds beside its worker (``EngineConfig.worker_extension_cls``),
  whose methods ``collective_rpc`` reaches (``update_weights``, ``update_weights_from_path``,
  ``init_weight_update_group`` / ``update_weights_from_distributed``, ``sleep``, ``wake_up``);
- ``loader.py``: checkpoint-named tensors into a rank's fused, sharded, maybe packed model, through the
  load path's own ``rename`` and ``load_shard``, re-running ``process_weights_after_loading``;
- ``group.py``: the gloo group a trainer process and the workers share to broadcast tensors, each checked
  against the trainer's HMAC;
- ``store.py``: the store that group forms through, hosted by the trainer on the address it names, which admits
  only peers holding the shared secret (``STAGEDSERVE_WEIGHT_SYNC_SECRET``);
- ``core.py``: the engine core's side: an update between steps with the prefix cache reset and the
  weight version counted, sleep levels 1 and 2, registered among the core's utilities
  (``core/utilities.py``; the busy loop runs them between steps, draining the requests in flight first);
- ``client.py``: the async front end's member (``AsyncEngine.weight_sync``, thread or engine-core
  process): the calls as utility calls, and 503s while asleep;
- the server's ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/update_weights`` behind ``--enable-dev-routes``
  live with the server (``server/dev_routes.py``), beside the core's own ``/collective_rpc`` and
  ``/reset_prefix_cache``.

The offline ``LLM`` has ``update_weights``, ``update_weights_from_path``, ``update_weights_from_distributed``,
``reload_weights``, ``sleep``, ``wake_up``, ``is_sleeping`` and ``weight_version`` (and, whatever is on,
the core's ``collective_rpc`` and ``reset_prefix_cache``). The course page: ``docs/rl-weight-updates.md``.

vLLM: ``vllm/entrypoints/llm.py`` (``LLM.collective_rpc``, ``sleep``, ``wake_up``), ``vllm/v1/worker/gpu_worker.py``
(``Worker.sleep`` / ``wake_up``), ``vllm/device_allocator/cumem.py`` (``CuMemAllocator``: the memory a
sleep unmaps), ``examples/offline_inference/rlhf.py``, ``rlhf_colocate.py`` and ``rlhf_utils.py``.
"""

from stage5_server.weight_sync.core import EngineSleepingError, WeightSync
from stage5_server.weight_sync.group import WeightBroadcaster, init_weight_update_group
from stage5_server.weight_sync.loader import describe_tensors

__all__ = ["EngineSleepingError", "WeightBroadcaster", "WeightSync", "describe_tensors", "init_weight_update_group"]
