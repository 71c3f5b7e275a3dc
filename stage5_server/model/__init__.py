"""The shared model, rearranged for serving: fused projections, a once-per-step RoPE table, every
linear layer behind one ``LinearMethod`` seam, the elementwise parts behind an ``ElementwiseKernels``
seam, and a compiled forward for steps of a few tokens on a CPU.
Stages 1-4 keep ``shared/model.py`` as written."""

from stage5_server.model.compile import CompiledDecodeForward, compile_decode_step, compile_problem
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

__all__ = ["UNQUANTIZED", "CompiledDecodeForward", "ElementwiseKernels", "FusedAttention", "FusedMLP", "Linear",
           "LinearMethod", "StepRMSNorm", "StepRotaryEmbedding", "compile_decode_step", "compile_problem",
           "fuse_projections", "use_elementwise_kernels", "use_linear_method"]
