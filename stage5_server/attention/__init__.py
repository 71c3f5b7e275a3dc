"""Attention backends: which code runs attention over the paged KV cache, and how much KV fits.

The model calls one backend object per step for every layer (``shared/model.py``); stage 5 picks
it from a registry: ``torch`` (stage 2's readable reference, any device), ``triton``
(``triton_backend.py`` over ``stage5_server/kernels/``, CUDA, or a CPU under ``TRITON_INTERPRET=1`` for tests)
or ``cpu`` (``cpu_attn.py``, batched SDPA). By default CUDA gets ``triton``, a CPU ``cpu``,
anything else ``torch``; ``triton`` where it cannot run is a ``ValueError`` at start-up.
``memory.py`` sizes the KV cache from free GPU memory.

vLLM: ``vllm/attention/selector.py`` and ``vllm/platforms/`` (backend selection),
``vllm/v1/attention/backends/``, and ``determine_available_memory`` in ``vllm/v1/worker/gpu_worker.py``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from stage2_paged.attention import PagedAttentionBackend
from stage5_server.attention.cpu_attn import CPUAttentionBackend
from stage5_server.attention.triton_backend import TritonAttentionBackend
from stage5_server.cpu_kernels.paged_decode import load_cpu_kernels

ATTENTION_BACKENDS = {"torch": PagedAttentionBackend, "triton": TritonAttentionBackend, "cpu": CPUAttentionBackend}


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device``, or None if it can."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'stagedserve[triton]')"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"device {device.type!r} has no Triton compiler; use CUDA, or set TRITON_INTERPRET=1 to interpret (slow)"


def resolve_attention_backend(name: str | None, device: torch.device) -> str:
    """The registry name to use for ``name`` (None or ``auto``: the device's default) on ``device``."""
    if name in (None, "auto"):
        if device.type == "cpu":
            return "cpu"
        return "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; choose auto or one of {sorted(ATTENTION_BACKENDS)}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend: cpu runs on a CPU only, not on device {device.type!r}")
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason:
            raise ValueError(f"attention_backend: triton cannot run here: {reason}")
    return name


def describe_attention_backend(name: str) -> str:
    """The start-up log's words for a backend; for ``cpu``, which path its decodes take."""
    if name != "cpu":
        return name
    problem = load_cpu_kernels()  # built here, before the workers load it
    return "cpu (decodes: the C++ operator, K/V read in place)" if problem is None else \
        f"cpu (decodes: SDPA over gathered blocks, because {problem})"


__all__ = ["ATTENTION_BACKENDS", "CPUAttentionBackend", "TritonAttentionBackend", "describe_attention_backend",
           "resolve_attention_backend", "triton_unavailable_reason"]
