"""One seam for every linear layer of stage 5's model: a ``LinearMethod`` computes the product.

``Linear`` is an ``nn.Linear`` whose forward asks its ``method`` for ``x @ W.T + b``. The method
every layer starts with is ``F.linear`` itself, what ``nn.Linear`` does, so float32 outputs stay
bit-identical. A packed, quantized or LoRA linear is another ``LinearMethod``: it may rewrite the
weights once after loading (``process_weights_after_loading``: prepack, quantize) and computes
the product its own way (``apply``). ``use_linear_method`` installs one on a loaded model, the
module swap after load that gpt-fast's ``quantize.py`` does. The fused projections (``fused.py``)
and the tensor-parallel layers (``parallel/layers.py``) are ``Linear``s too, so one method class
serves all of them.

vLLM: ``LinearBase``, ``LinearMethodBase`` and ``UnquantizedLinearMethod`` in
``vllm/model_executor/layers/linear.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """Unquantized: the weights as loaded, the product by ``F.linear``."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def describe(self, layer: Linear) -> str:
        """How this layer's product runs, for the start-up log."""
        return "plain"

    def weight_bytes(self, layer: Linear) -> int:
        """Bytes this layer's weight takes as the method holds it."""
        return layer.weight.numel() * layer.weight.element_size()

    def row_split(self) -> int | None:
        """The row count above which this method computes its products another way (``dispatch.py``),
        or None. A compiled graph's range of rows ends there (``compile.py``): each graph holds one way."""
        return None


UNQUANTIZED = LinearMethod()


class Linear(nn.Linear):
    method: LinearMethod = UNQUANTIZED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    @classmethod
    def sharing(cls, linear: nn.Linear) -> Linear:
        """A ``Linear`` holding ``linear``'s own parameters (a tied weight stays tied)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer


def use_linear_method(model: nn.Module, method: LinearMethod = UNQUANTIZED) -> nn.Module:
    """Make every linear layer of ``model`` a ``Linear`` computed by ``method``; returns ``model``."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, Linear.sharing(child))
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.method = method
            method.process_weights_after_loading(layer)
    return model
