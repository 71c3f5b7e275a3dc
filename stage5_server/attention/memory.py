"""How much GPU memory the KV cache gets: what ``gpu_memory_utilization`` of the card leaves
after the weights and the activations of the largest step.

One forward of ``min(max_num_batched_tokens, max_model_len)`` tokens runs without a KV cache; its
peak, the weights and other processes' memory come off ``utilization * total``, the rest is the
KV budget. Under tensor parallelism each rank profiles its shard; the tightest decides.

vLLM: ``Worker.determine_available_memory`` in ``vllm/v1/worker/gpu_worker.py``.
"""

from __future__ import annotations

import torch

from shared.attention import causal_attention


def profile_free_kv_memory(model, device: torch.device, num_tokens: int, utilization: float) -> int:
    """One forward of ``num_tokens`` tokens, no KV cache; KV gets what its peak leaves of ``utilization * total``."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model.set_attention_backend(_NoCacheAttention())
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), None)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    other_processes = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - peak - max(0, other_processes)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: {utilization} leaves no memory for the KV cache "
                         f"(weights and activations peak at {peak / 2**30:.2f} GiB)")
    return budget


class _NoCacheAttention:
    """Causal attention over the profiling batch itself (one sequence, nothing stored)."""

    def forward(self, layer_idx, query, key, value, attn_metadata, scale):
        return causal_attention(query, key, value, scale)
