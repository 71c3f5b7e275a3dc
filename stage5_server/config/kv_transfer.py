"""``kv_transfer_config`` and ``kv_offloading_size``: which KV connector the engine runs, checked once.

``stagedserve serve --kv-transfer-config '{...}'`` (and ``LLM(kv_transfer_config={...})``) take vLLM's keys:

- ``kv_connector``: ``"OffloadingConnector"`` (a second tier in host memory, ``kv_role`` ``kv_both``) or
  ``"P2pZmqConnector"`` (prefill/decode disaggregation over ZeroMQ: ``kv_producer`` on the prefill
  instance, ``kv_consumer`` on the decode instance);
- ``kv_role``: ``kv_both``, ``kv_producer`` or ``kv_consumer``;
- ``kv_connector_extra_config``: the connector's own settings. ``OffloadingConnector``:
  ``cpu_bytes_to_use`` (the tier's bytes, summed over the ranks). ``P2pZmqConnector``: ``kv_host`` /
  ``kv_port``, the consumer's receiving address (the consumer binds it; the producer sends to it;
  ``kv_host`` defaults to 127.0.0.1), on the consumer ``buffer_bytes``, the most received K/V it
  keeps (default 1 GiB), and on both ``max_message_bytes``, the largest message part the consumer takes
  and the producer sends (default 64 MiB). Both instances also need the same secret in
  ``$STAGEDSERVE_KV_TRANSFER_SECRET`` (``kv_transfer/peer_auth.py``).

``--kv-offloading-size GiB`` is vLLM's shorthand for the first: an ``OffloadingConnector`` whose
``cpu_bytes_to_use`` is that many GiB.

vLLM: ``KVTransferConfig`` in ``vllm/config/kv_transfer.py``; ``_post_init_kv_transfer_config`` in
``vllm/config/vllm.py`` (``kv_offloading_size`` -> ``OffloadingConnector``, ``cpu_bytes_to_use``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from stage5_server.arg_types import checked_json_object, json_object_argument

KV_CONNECTORS = {"OffloadingConnector": ("kv_both",), "P2pZmqConnector": ("kv_producer", "kv_consumer")}
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
EXTRA_KEYS = {"OffloadingConnector": ("cpu_bytes_to_use",),
              "P2pZmqConnector": ("kv_host", "kv_port", "buffer_bytes", "max_message_bytes")}
DEFAULT_P2P_BUFFER_BYTES = 1 << 30
DEFAULT_P2P_MAX_MESSAGE_BYTES = 64 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def is_consumer(self) -> bool:
        return self.kv_role == "kv_consumer"

    @property
    def cpu_bytes_to_use(self) -> int:
        return self.kv_connector_extra_config.get("cpu_bytes_to_use", 0)

    @property
    def address(self) -> str:
        """The consumer's receiving address, as ZeroMQ names it."""
        extra = self.kv_connector_extra_config
        return f"tcp://{extra.get('kv_host', '127.0.0.1')}:{extra['kv_port']}"

    @property
    def buffer_bytes(self) -> int:
        return self.kv_connector_extra_config.get("buffer_bytes", DEFAULT_P2P_BUFFER_BYTES)

    @property
    def max_message_bytes(self) -> int:
        return self.kv_connector_extra_config.get("max_message_bytes", DEFAULT_P2P_MAX_MESSAGE_BYTES)

    @classmethod
    def create(cls, value: dict[str, Any] | str | KVTransferConfig | None,
               kv_offloading_size: float | None = None) -> KVTransferConfig | None:
        """``value`` as ``LLM`` or the command line gives it (a dict, its JSON text, or None), or an
        ``OffloadingConnector`` of ``kv_offloading_size`` GiB; None: no connector."""
        if kv_offloading_size is not None:
            if isinstance(kv_offloading_size, bool) or not isinstance(kv_offloading_size, (int, float)) \
                    or not 0 < kv_offloading_size < math.inf:
                raise ValueError(f"kv_offloading_size: must be a positive number of GiB, got {kv_offloading_size!r}")
            if value is not None:
                raise ValueError("kv_offloading_size: give it or kv_transfer_config, not both")
            value = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"cpu_bytes_to_use": int(kv_offloading_size * GIB)}}
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object_argument("kv_transfer_config", value, KV_TRANSFER_KEYS)
        connector, role = value.get("kv_connector"), value.get("kv_role")
        if connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector: must be one of {list(KV_CONNECTORS)}, "
                             f"got {connector!r}")
        if role not in KV_CONNECTORS[connector]:
            raise ValueError(f"kv_transfer_config.kv_role: {connector} takes {list(KV_CONNECTORS[connector])}, "
                             f"got {role!r}")
        extra = value.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: must be a JSON object, got {extra!r}")
        unknown = sorted(set(extra) - set(EXTRA_KEYS[connector]))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key {unknown[0]!r} for "
                             f"{connector}; accepted: {list(EXTRA_KEYS[connector])}")
        for name in ("cpu_bytes_to_use", "buffer_bytes", "max_message_bytes"):
            if name in extra and not (_is_int(extra[name]) and extra[name] > 0):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name}: must be a positive "
                                 f"integer of bytes, got {extra[name]!r}")
        if connector == "OffloadingConnector" and "cpu_bytes_to_use" not in extra:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use: OffloadingConnector "
                             "needs the tier's size in bytes (or give kv_offloading_size in GiB)")
        if connector == "P2pZmqConnector":
            port = extra.get("kv_port")
            if not (_is_int(port) and 0 < port < 65536):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.kv_port: the consumer's port "
                                 f"(1-65535), got {port!r}")
            host = extra.get("kv_host", "127.0.0.1")
            if not (isinstance(host, str) and host and all(c.isalnum() or c in ".:-" for c in host)):
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.kv_host: an address, got {host!r}")
            if role == "kv_producer" and "buffer_bytes" in extra:
                raise ValueError("kv_transfer_config.kv_connector_extra_config.buffer_bytes: the consumer's "
                                 "setting (kv_role kv_consumer)")
        return cls(connector, role, dict(extra))


kv_transfer_config_arg = checked_json_object(KVTransferConfig.create)  # --kv-transfer-config


def check_kv_transfer_support(config: KVTransferConfig | None, *, runner: str, enable_prefix_caching: bool,
                              hash_algo: str, world_size: int) -> None:
    """A connector finds blocks by their prefix-cache hash: caching on, the same hash in every process
    (sha256; "fast" is salted per process), and a runner that keeps KV. Disaggregation moves whole
    blocks between two one-rank engines."""
    if config is None:
        return
    if runner != "generate":
        raise ValueError("kv_transfer_config: the pooling runner keeps no KV to transfer")
    if not enable_prefix_caching:
        raise ValueError("kv_transfer_config: a KV connector finds blocks by their prefix-cache hash; "
                         "turn prefix caching on")
    if hash_algo != "sha256":
        raise ValueError("kv_transfer_config: a KV connector needs the sha256 block hash (the same in every "
                         f"process), got {hash_algo!r}")
    if config.kv_connector == "P2pZmqConnector" and world_size > 1:
        raise ValueError("kv_transfer_config: P2pZmqConnector moves whole blocks between one-rank engines "
                         f"(tensor_parallel_size and pipeline_parallel_size 1; here {world_size} ranks)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
