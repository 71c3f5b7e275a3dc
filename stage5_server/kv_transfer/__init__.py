"""KV transfer: K/V blocks moved in and out of the engine's pool through one seam, the KV connector.

- ``base.py``: the seam, its scheduler-side and worker-side calls (vLLM's names);
- ``lookup.py``: where a connector's blocks enter the pool, during a prefix lookup;
- ``offload.py``: a second tier in host memory that keeps blocks past a full pool (``--kv-offloading-size``);
- ``p2p.py``: prefill/decode disaggregation, a prefill engine sending the blocks it computes to a decode
  engine (``--kv-transfer-config`` with ``kv_producer`` / ``kv_consumer``);
- ``proxy.py``: the small HTTP proxy in front of such a pair (``stagedserve disagg-proxy``).

The engine plugs it in at three places: stage 5's KV cache manager asks the connector during a prefix
lookup (``core/kv_cache_manager.py`` calls ``lookup.py``), the scheduler puts its per-step metadata on
the ``SchedulerOutput``, and each worker calls it around the forward. The course page: ``docs/kv-transfer.md``.

vLLM: ``vllm/distributed/kv_transfer/`` (``kv_connector/factory.py``'s ``KVConnectorFactory``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stage5_server.kv_transfer.base import FilledBlock, KVConnectorBase, KVConnectorMetadata, KVConnectorRole

if TYPE_CHECKING:
    from stage5_server.config.kv_transfer import KVTransferConfig


def make_kv_connector(config: KVTransferConfig | None, role: KVConnectorRole, block_size: int,
                      block_bytes: int, world_size: int = 1,
                      layout: tuple[int, int, int, torch.dtype] | None = None) -> KVConnectorBase | None:
    """The connector ``config`` names, for one side; None when there is none. ``block_bytes``: one block of
    every layer's K and V on a rank (the scheduler passes the largest rank's); ``layout``: the model's
    ``(layers, kv_heads, head_dim, dtype)``, what a block received from another engine must have."""
    if config is None:
        return None
    if config.kv_connector == "OffloadingConnector":
        from stage5_server.kv_transfer.offload import OffloadingConnector

        return OffloadingConnector(config, role, block_size, config.cpu_bytes_to_use // world_size // block_bytes)
    from stage5_server.kv_transfer.p2p import P2pZmqConnector

    return P2pZmqConnector(config, role, block_size, layout)


__all__ = ["FilledBlock", "KVConnectorBase", "KVConnectorMetadata", "KVConnectorRole", "make_kv_connector"]
