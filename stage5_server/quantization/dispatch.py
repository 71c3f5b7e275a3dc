"""Two methods for one layer, chosen per product by its number of rows.

A decode step at a small batch multiplies a few rows by every weight: it reads the whole weight for
little arithmetic, so the method that reads the fewest bytes wins (a 4-bit weight is a quarter of
bfloat16's). torch's int8/int4 CPU kernels are matrix-vector loops, though: their cost grows with
every row, while oneDNN's packed GEMM reuses each weight tile across rows. So a prefill chunk or a
large decode batch is faster on the packed float weight. ``RowDispatchLinearMethod`` keeps both
copies and picks per call: the quantized method up to ``max_rows`` rows, the packed one above.
Measured on the default model in bfloat16 (``docs/performance.md``), the int4 blocks are 1.7x the
packed weight's speed at one decode row and even at eight; a 128-token prefill is 2x faster packed.

A compiled step (``model/compile.py``) gives each side of ``max_rows`` graphs of their own
(``row_split``), so that in each graph the choice is known when it is traced.

vLLM: ``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py`` picks a CPU GEMM
kernel per layer from its shapes; llama.cpp picks a matrix-vector or matrix-matrix kernel per call
from the batch size (``ggml_compute_forward_mul_mat`` in ``ggml/src/ggml-cpu/ggml-cpu.c``).
"""

from __future__ import annotations

import torch

from stage5_server.model.linear import Linear, LinearMethod

QUANTIZED_MAX_ROWS = 8  # rows up to which the quantized weight is read (measured even at 8)


class RowDispatchLinearMethod(LinearMethod):
    """``few`` (a quantized method) for products of at most ``max_rows`` rows, ``many`` (packed)
    above; each keeps its own copy of the weight."""

    def __init__(self, few: LinearMethod, many: LinearMethod, max_rows: int = QUANTIZED_MAX_ROWS):
        self.few, self.many, self.max_rows = few, many, max_rows

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight
        self.few.process_weights_after_loading(layer)  # may quantize layer.weight, then drops it
        layer.weight = weight
        self.many.process_weights_after_loading(layer)  # packs it (and drops the plain copy)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        method = self.few if rows <= self.max_rows else self.many
        return method.apply(layer, x, bias)

    def describe(self, layer: Linear) -> str:
        return f"{self.few.describe(layer)} up to {self.max_rows} rows, else {self.many.describe(layer)}"

    def weight_bytes(self, layer: Linear) -> int:
        return self.few.weight_bytes(layer) + self.many.weight_bytes(layer)

    def row_split(self) -> int | None:
        return self.max_rows
