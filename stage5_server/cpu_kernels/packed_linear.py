"""oneDNN's GEMM over a weight packed at load, as an operator a compiled graph holds.

``csrc/packed_linear.cpp`` registers ``torch.ops.stagedserve_cpu.packed_linear``: the call
``quantization/packed.py`` makes eagerly (``torch.ops.mkldnn._linear_pointwise``) behind a schema of
its own, whose fake kernel (``build.py``) gives inductor the output's shape. Inductor lowers the mkldnn
call only for a weight it packed itself while freezing a graph; this one it calls as it is, between its
own loops, so a compiled step (``model/compile.py``) runs on packed weights too.

vLLM: its CPU GEMMs are custom operators as well (``onednn_mm`` in ``csrc/cpu/dnnl_kernels.cpp``,
called from ``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``).
"""

from __future__ import annotations

import torch


def cpu_packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` packed by ``torch.ops.mkldnn._reorder_linear_weight``
    (``out_features`` rows)."""
    return torch.ops.stagedserve_cpu.packed_linear(x, packed_weight, bias, out_features)
