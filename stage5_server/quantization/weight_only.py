"""Weight-only int8 and int4 linears: the weights stay 8 or 4 bits in memory and are widened inside
torch's own CPU kernels, so a decode step reads a half or a quarter of bfloat16's bytes.

- int8: one symmetric scale per output row, ``w ~ scale[n] * q`` with ``q`` in -127..127, quantized
  from the loaded float weights; ``torch.ops.aten._weight_int8pack_mm``, or on a CPU with
  AVX512-VNNI stage5's own operator, which quantizes the activations to int8 as well.
- int4: groups of ``GROUP_SIZE`` (32) weights along the input dimension, each with a scale and a
  zero point, ``w ~ (q - 8) * scale + zero`` with ``q`` in 0..15 (the kernel's convention: ``zero``
  is the value of the middle code 8). From float weights a group is quantized asymmetrically
  between its min and max, as llama.cpp's Q4_1 does; from a GGUF file the groups are the file's own
  blocks (``gguf.py``). ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` packs the codes
  once, ``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies.

The int4 path's activations stay in the model's dtype (the scales are stored in it too); a bias is added after.
These kernels are built for bfloat16: in float32 they are slower than ``F.linear``.

gpt-fast: ``WeightOnlyInt8QuantHandler`` and ``WeightOnlyInt4QuantHandler`` in ``quantize.py``
(the module swap after load). vLLM runs the same torch kernels through torchao
(``vllm/model_executor/layers/quantization/torchao.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stage5_server.cpu_kernels.int8_linear import GROUP as INT8_DOT_GROUP
from stage5_server.cpu_kernels.int8_linear import cpu_int8_linear, int8_dot_problem
from stage5_server.model.linear import Linear, LinearMethod

GROUP_SIZE = 32  # int4 weights per scale/zero, along the input dimension (GGUF's block size)
INT4_INNER_K_TILES = 2  # the packing's tile width, as gpt-fast passes it for a CPU
INT4_N_MULTIPLE = 16  # the packing wants output rows in multiples of 16
KERNELS = {"int8": ("_weight_int8pack_mm",),
           "int4": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")}


def kernel_available(method: str) -> bool:
    """This torch has the CPU ops the ``int8`` or ``int4`` method runs on."""
    return all(hasattr(torch.ops.aten, op) for op in KERNELS[method])


def int4_shape_problem(out_features: int, in_features: int) -> str | None:
    """Why a weight of this shape cannot be an int4 weight here, or None."""
    if in_features % GROUP_SIZE:
        return f"its input size {in_features} is not a multiple of the group size {GROUP_SIZE}"
    if out_features % INT4_N_MULTIPLE:
        return f"its output size {out_features} is not a multiple of {INT4_N_MULTIPLE}"
    return None


@dataclass
class Int4Groups:
    """One weight as int4 groups: ``codes [N, K]`` in 0..15, ``scale`` and ``zero`` ``[N, K // 32]``
    (float32), each weight reading back as ``(code - 8) * scale + zero``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Groups:
        """Each group of 32 between its min and max: scale ``(max - min) / 15``, code 0 is the min."""
        n, k = weight.shape
        groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        return cls(codes.to(torch.uint8).reshape(n, k), scale, low + 8 * scale)

    @classmethod
    def cat(cls, parts: list[Int4Groups]) -> Int4Groups:
        """The weights' rows stacked (a fused projection)."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        groups = self.codes.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE) - 8
        return (groups * self.scale[..., None] + self.zero[..., None]).reshape(n, k)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``(codes int8 [N, K], scale float32 [N])``, ``w ~ scale * code``."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _drop_float_weight(layer: Linear) -> None:
    """The quantized copy is the weight now (a tied LM head's embedding keeps its own)."""
    layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)


class Int8LinearMethod(LinearMethod):
    """Per-row int8 weights. ``source``: float32 values to quantize instead of the layer's weight
    (a GGUF Q8_0 tensor's dequantized values).

    On a CPU with AVX512-VNNI (and the C++ operators built) the activations are quantized to int8 too,
    in groups of 64, and multiplied in integers (``cpu_kernels/int8_linear.py``); elsewhere torch's
    ``_weight_int8pack_mm`` widens the weights. ``int8_activations``: None picks by the machine."""

    name = "int8"

    def __init__(self, source: torch.Tensor | None = None, note: str = "", int8_activations: bool | None = None):
        self.source, self.note, self.int8_activations = source, note, int8_activations

    def process_weights_after_loading(self, layer: Linear) -> None:
        dtype, device = layer.weight.dtype, layer.weight.device
        if self.int8_activations is None:
            self.int8_activations = device.type == "cpu" and layer.in_features % INT8_DOT_GROUP == 0 \
                and int8_dot_problem() is None
        codes, scale = quantize_int8(layer.weight if self.source is None else self.source)
        # The integer path keeps float32 scales; torch's kernel wants them in the activations' dtype.
        layer.int8_weight, layer.int8_scale = codes.to(device), scale.to(device, torch.float32 if
                                                                          self.int8_activations else dtype)
        self.source = None
        _drop_float_weight(layer)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.int8_activations:
            out = cpu_int8_linear(rows, layer.int8_weight, layer.int8_scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, layer.int8_weight, layer.int8_scale)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def describe(self, layer: Linear) -> str:
        return ("int8 with int8 activations" if self.int8_activations else "int8") + \
            (f" ({self.note})" if self.note else "")

    def weight_bytes(self, layer: Linear) -> int:
        return layer.int8_weight.numel() + layer.int8_scale.numel() * layer.int8_scale.element_size()


class Int4LinearMethod(LinearMethod):
    """Int4 groups of 32. ``source``: the groups to use instead of quantizing the layer's weight
    (a GGUF file's Q4_0/Q4_1 blocks)."""

    name = "int4"

    def __init__(self, source: Int4Groups | None = None, note: str = ""):
        self.source, self.note = source, note

    def process_weights_after_loading(self, layer: Linear) -> None:
        problem = int4_shape_problem(layer.out_features, layer.in_features)
        if problem:
            raise ValueError(f"quantization: int4 cannot hold a {layer.out_features}x{layer.in_features} "
                             f"weight: {problem}")
        dtype, device = layer.weight.dtype, layer.weight.device
        groups = Int4Groups.quantize(layer.weight) if self.source is None else self.source
        layer.int4_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            groups.codes.to(device, torch.int32), INT4_INNER_K_TILES)
        # [K // 32, N, 2]: per group and output row, (scale, zero), in the activations' dtype.
        layer.int4_scales_zeros = torch.stack([groups.scale, groups.zero], dim=-1).transpose(0, 1) \
            .contiguous().to(device, dtype)
        self.source = None
        _drop_float_weight(layer)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, layer.int4_weight, GROUP_SIZE,
                                                         layer.int4_scales_zeros)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def describe(self, layer: Linear) -> str:
        return "int4" + (f" ({self.note})" if self.note else "")

    def weight_bytes(self, layer: Linear) -> int:
        scales = layer.int4_scales_zeros
        return layer.int4_weight.numel() * layer.int4_weight.element_size() + scales.numel() * scales.element_size()
