"""The shared model, rearranged for serving: fused projections, a once-per-step RoPE table, every
linear layer behind one ``LinearMethod`` seam, and an opt-in ``torch.compile`` of the forward.
Stages 1-4 keep ``shared/model.py`` as written."""

from stage5_server.model.compile import EagerAttention, compile_model
from stage5_server.model.fused import FusedAttention, FusedMLP, StepRotaryEmbedding, fuse_projections
from stage5_server.model.linear import UNQUANTIZED, Linear, LinearMethod, use_linear_method

__all__ = ["UNQUANTIZED", "EagerAttention", "FusedAttention", "FusedMLP", "Linear", "LinearMethod",
           "StepRotaryEmbedding", "compile_model", "fuse_projections", "use_linear_method"]
