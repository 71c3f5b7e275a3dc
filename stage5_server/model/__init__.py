"""The shared model, rearranged for serving: fused projections, a once-per-step RoPE table, and
an opt-in ``torch.compile`` of the forward. Stages 1-4 keep ``shared/model.py`` as written."""

from stage5_server.model.compile import EagerAttention, compile_model
from stage5_server.model.fused import FusedAttention, FusedMLP, StepRotaryEmbedding, fuse_projections

__all__ = ["EagerAttention", "FusedAttention", "FusedMLP", "StepRotaryEmbedding", "compile_model", "fuse_projections"]
