"""Int8 weights times int8 activations on a CPU: the integer dot products of AVX512-VNNI.

``csrc/int8_linear.cpp`` registers ``torch.ops.stagedserve_cpu.int8_linear``: the activations of
each input row are quantized to int8 in groups of 64 on the fly, multiplied with an int8 weight
(one scale per output row) in int32, and scaled back, as llama.cpp multiplies a Q8_0 weight. torch's
``_weight_int8pack_mm`` widens each weight to a float instead; for one decode row over the default
model's 49,152 x 576 LM head it measured 2.8 times faster on an AVX512-VNNI CPU, twice as fast at
four and eight rows (``benchmarks/int8_linear.py``). Quantizing the activations costs closeness,
not identity: the int8 linear method runs it for every product it computes (up to 8 rows where
packed weights take the larger ones), and the suite holds it to logprob closeness.

llama.cpp: ``ggml_vec_dot_q8_0_q8_0`` in ``ggml/src/ggml-cpu/arch/x86/quants.c``; vLLM's CPU W8A8
path (``csrc/cpu/dnnl_kernels.cpp``) quantizes activations per token for oneDNN.
"""

from __future__ import annotations

import functools

import torch

from stage5_server.cpu_kernels.build import cpu_flags, load_cpu_kernels

GROUP = 64  # activations per int8 scale (the operator's)
NEEDED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")


@functools.cache
def int8_dot_problem() -> str | None:
    """Why the operator is not the fast path on this machine (not built, or no AVX512-VNNI), or None."""
    problem = load_cpu_kernels()
    if problem:
        return problem
    flags = set(cpu_flags().split())
    missing = [flag for flag in NEEDED_FLAGS if flag not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def cpu_int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (scale[:, None] * weight).T`` with ``x`` quantized to int8 per ``GROUP`` inputs:
    ``weight`` int8 ``[N, K]``, ``scale`` float32 ``[N]``; ``[M, N]`` in ``x``'s dtype."""
    return torch.ops.stagedserve_cpu.int8_linear(x, weight, scale)


def reference_int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The operator's arithmetic in torch, for tests: the same codes, the sums in float64."""
    m, k = x.shape
    groups = x.float().reshape(m, k // GROUP, GROUP)
    d = groups.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(groups / torch.where(d > 0, d, torch.ones_like(d)))
    dots = torch.einsum("mgi,ngi->mng", codes.double(), weight.double().reshape(-1, k // GROUP, GROUP))
    out = (dots * d.double().squeeze(-1)[:, None, :]).sum(-1) * scale.double()
    return out.to(x.dtype)
