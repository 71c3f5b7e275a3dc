"""The shared model, rearranged for serving: fused projections, a once-per-step RoPE table, every
linear layer behind one ``LinearMethod`` seam, the elementwise parts behind an ``ElementwiseKernels``
seam, and a compiled forward for every step on a CPU.
Stages 1-4 keep ``shared/model.py`` as written."""

from stage5_server.model.compile import DECODE_BUCKETS, CompiledForward, compile_step
from stage5_server.model.fused import (
    ElementwiseKernels,
    FusedAttention,
    FusedMLP,
    StepRMSNorm,
    StepRotaryEmbedding,
    fuse_projections,
    use_elementwise_kernels,
)
from stage5_server.model.linear import UNQUANTIZED, Linear, LinearMethod, use_linear_method

__all__ = ["DECODE_BUCKETS", "UNQUANTIZED", "CompiledForward", "ElementwiseKernels", "FusedAttention", "FusedMLP",
           "Linear", "LinearMethod", "StepRMSNorm", "StepRotaryEmbedding", "compile_step", "fuse_projections",
           "use_elementwise_kernels", "use_linear_method"]
