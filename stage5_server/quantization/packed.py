"""Prepacked GEMMs: each linear layer's weight reordered once, at load, into the blocked layout
oneDNN's GEMM reads fastest, instead of on every call.

``F.linear`` on a CPU hands oneDNN (bfloat16) or MKL (float32) a plain row-major weight, and the
library reorders it into its own tiles inside the call; at decode's batch of one that reorder is
a large part of the work. ``torch.ops.mkldnn._reorder_linear_weight`` packs the weight once and
``torch.ops.mkldnn._linear_pointwise`` multiplies by the packed weight: the pair inductor's
freezing pass emits for a frozen linear on a CPU. A layer whose weight this torch cannot pack
(no oneDNN, or oneDNN refuses the weight) keeps ``F.linear``. The packed weight replaces the
plain one, so the model holds each weight once (a tied LM head's embedding stays as it was).

Inductor lowers ``_linear_pointwise`` only for a weight it packed itself while freezing a graph, so
inside a compiled step (``model/compile.py``) the product is ``cpu_kernels``' ``packed_linear``: the
same call as a C++ operator with a fake kernel (``torch.library``) that gives inductor the output's
shape, an opaque call the generated code makes between its own loops.

vLLM: ``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py`` (oneDNN's
``onednn_mm`` over a weight packed at load time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stage5_server.cpu_kernels import cpu_packed_linear
from stage5_server.model.linear import Linear, LinearMethod


def packing_available() -> bool:
    """This torch has oneDNN and its linear packing ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's packed layout, or None where it cannot be packed (then: ``F.linear``)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not packing_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # None: any batch size
    except RuntimeError:
        return None


class PackedLinearMethod(LinearMethod):
    """The weight packed once for oneDNN; ``F.linear`` where it could not be packed."""

    name = "packed"

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.packed_weight = pack_weight(layer.weight)
        if layer.packed_weight is not None:  # the packed copy is the weight now
            layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.packed_weight is None:
            return F.linear(x, layer.weight, bias)
        if torch.compiler.is_compiling():  # the operator a graph holds (module docstring)
            return cpu_packed_linear(x, layer.packed_weight, bias, layer.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")

    def describe(self, layer: Linear) -> str:
        return "packed" if layer.packed_weight is not None else "plain (could not pack)"

    def weight_bytes(self, layer: Linear) -> int:
        weight = layer.packed_weight if layer.packed_weight is not None else layer.weight
        return weight.numel() * weight.element_size()
