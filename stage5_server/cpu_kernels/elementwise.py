"""A layer's elementwise parts on a CPU, one operator each: RMSNorm, SiLU(gate) * up, RoPE's rotation.

``csrc/elementwise.cpp`` registers ``torch.ops.stagedserve_cpu.rms_norm``, ``silu_and_mul`` and
``rotate_half``. Eager torch runs RMSNorm as six calls (a cast, a square, a mean, an add and rsqrt, a
multiply, a cast back and the weight's multiply), each a pass over memory; the operator makes one
pass and keeps the float math in registers. Each rounds where the torch code rounds, so bfloat16
results match the torch path's but for the order of a float sum. ``CPUElementwiseKernels`` is what
the model's elementwise seam takes (``model/fused.py``'s ``use_elementwise_kernels``); the worker
gives it to a model in bfloat16 or float16 on a CPU, where the operators built. A float32 model keeps
the torch code, the reference that stays token-identical to transformers; so does every model with
``STAGEDSERVE_CPU_ELEMENTWISE_KERNELS=0`` (to compare the two).

vLLM: ``csrc/cpu/layernorm.cpp``, ``csrc/cpu/activation.cpp``, ``csrc/cpu/pos_encoding.cpp``, behind
``CustomOp.forward_cpu``.
"""

from __future__ import annotations

import os

import torch

from stage5_server.cpu_kernels.build import load_cpu_kernels

LOW_PRECISION = (torch.bfloat16, torch.float16)
SWITCH = "STAGEDSERVE_CPU_ELEMENTWISE_KERNELS"  # "0": the torch code everywhere


class CPUElementwiseKernels:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.stagedserve_cpu.rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[rows, 2 * width]`` (gate, then up) -> ``silu(gate) * up``, ``[rows, width]``."""
        return torch.ops.stagedserve_cpu.silu_and_mul(gate_up)

    def rotate_half(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated in the Hugging Face layout by ``cos``/``sin`` ``[T, 1, D]``."""
        return torch.ops.stagedserve_cpu.rotate_half(x, cos, sin)


def cpu_elementwise_kernels(device: torch.device, dtype: torch.dtype) -> CPUElementwiseKernels | None:
    """The kernels for a model of ``dtype`` on ``device``; None where the torch code runs (not a CPU,
    float32, switched off, or the operators did not build)."""
    if device.type != "cpu" or dtype not in LOW_PRECISION or os.environ.get(SWITCH, "1").strip() == "0":
        return None
    if load_cpu_kernels() is not None:
        return None
    return CPUElementwiseKernels()
