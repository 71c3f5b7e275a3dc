"""The attention-backend registry: which code runs attention over the paged KV cache.

``torch`` is stage2's reference (any device). ``triton`` runs the kernels in
``stage5_server/kernels`` on CUDA, or on a CPU under the Triton interpreter
(``TRITON_INTERPRET=1``, slow, for tests). By default the device decides: CUDA gets
``triton``, everything else ``torch``. Asking for ``triton`` where it cannot run is a
clear ``ValueError`` at start-up, not a crash inside a kernel launch.

vLLM: ``vllm/attention/selector.py`` and ``vllm/platforms/`` (backend selection) and
``vllm/v1/attention/backends/triton_attn.py``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from stage2_paged.attention import PagedAttentionBackend, PagedAttentionMetadata


class TritonAttentionBackend:
    """Writes new K/V with ``reshape_and_cache``, then runs ``triton_paged_attention``."""

    def __init__(self, kv_cache):
        from stage5_server import kernels  # imported here: Triton reads TRITON_INTERPRET at import

        self.kernels = kernels
        self.kv_cache = kv_cache

    def forward(self, layer_idx, query, key, value, meta: PagedAttentionMetadata, scale):
        key_cache, value_cache = self.kv_cache.key[layer_idx], self.kv_cache.value[layer_idx]
        self.kernels.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return self.kernels.triton_paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                                   meta.query_start_loc, scale, max_query_len=meta.max_query_len,
                                                   max_seq_len=meta.max_seq_len)


ATTENTION_BACKENDS = {"torch": PagedAttentionBackend, "triton": TritonAttentionBackend}


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device``, or None if it can."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'stagedserve[triton]')"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"device {device.type!r} has no Triton compiler; use CUDA, or set TRITON_INTERPRET=1 to interpret (slow)"


def resolve_attention_backend(name: str | None, device: torch.device) -> str:
    if name in (None, "auto"):
        return "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; choose auto or one of {sorted(ATTENTION_BACKENDS)}")
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason:
            raise ValueError(f"attention_backend: triton cannot run here: {reason}")
    return name
