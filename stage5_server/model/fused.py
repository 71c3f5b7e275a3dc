"""Fused projections and a once-per-step rotary table: the shared model, rearranged for speed.

``shared/model.py`` runs seven matrix multiplies per layer and recomputes RoPE's cos/sin in every
layer. After loading, q, k and v become one GEMM whose output is split, gate and up another (four
larger GEMMs instead of seven), and the step's cos/sin table is built once. The weights are the
same, their rows concatenated, so float32 outputs stay token-identical; under tensor parallelism
each rank fuses its own shards. Every projection, fused or not, ends up a ``linear.Linear``.

The elementwise parts (RMSNorm, SiLU(gate) * up, RoPE's rotation) are a second seam:
``use_elementwise_kernels`` gives the norms, the MLPs and the rotary table an ``ElementwiseKernels``
(one operator each instead of four to six torch calls; ``cpu_kernels/elementwise.py``). Without
one, and inside a compiled graph (which fuses them itself), they run the torch code.

vLLM: ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` in
``vllm/model_executor/layers/linear.py`` (there the checkpoint is loaded straight into the fused weight);
the elementwise seam is ``CustomOp`` (``vllm/model_executor/custom_op.py``: ``forward_native`` or
``forward_cpu``) as ``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` use it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shared.model import Attention, DecoderModel, RMSNorm, RotaryEmbedding
from stage5_server.model.linear import Linear, use_linear_method


class ElementwiseKernels(Protocol):
    """One operator for each elementwise part of a layer, rounding as the torch code does."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def rotate_half(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


def _kernels_for(module: nn.Module) -> ElementwiseKernels | None:
    """The module's kernels, unless there are none or a graph is being compiled."""
    kernels = module.elementwise
    return None if kernels is None or torch.compiler.is_compiling() else kernels


def _merged(*linears: nn.Linear) -> Linear:
    """One Linear whose output rows are the given Linears' rows, in order (biases alike)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    merged = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        merged.bias = nn.Parameter(bias, requires_grad=False)
    return merged


class FusedAttention(nn.Module):
    """``shared.model.Attention`` with q, k and v in one GEMM; same backend seam."""

    def __init__(self, attn: Attention):
        super().__init__()
        self.layer_idx, self.scale = attn.layer_idx, attn.scale
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qkv_proj = _merged(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        if hasattr(attn, "q_norm"):
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.split = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                      self.num_kv_heads * self.head_dim]
        self.backend = attn.backend

    def forward(self, positions, hidden, attn_metadata, rope):
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = self.backend.forward(self.layer_idx, q, k, v, attn_metadata, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one GEMM."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up_proj = _merged(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.elementwise: ElementwiseKernels | None = None

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if (kernels := _kernels_for(self)) is not None and gate_up.dim() == 2:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class StepRMSNorm(RMSNorm):
    """``shared.model.RMSNorm``, through the elementwise kernels when there are some."""

    def __init__(self, norm: RMSNorm):
        nn.Module.__init__(self)
        self.weight, self.eps = norm.weight, norm.eps
        self.elementwise: ElementwiseKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (kernels := _kernels_for(self)) is not None and x.dtype == self.weight.dtype:
            return kernels.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class StepRotaryEmbedding(RotaryEmbedding):
    """RoPE whose cos/sin for a step's ``positions`` are computed by the first layer only."""

    def __init__(self, rope: RotaryEmbedding):
        nn.Module.__init__(self)
        self.register_buffer("inv_freq", rope.inv_freq, persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self.elementwise: ElementwiseKernels | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if torch.compiler.is_compiling():  # a compiled step computes the table once in its own graph
            return super().forward(positions, q, k)
        if positions is not self._positions or self._cos_sin[0].dtype != q.dtype:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = emb.cos()[:, None, :].to(q.dtype), emb.sin()[:, None, :].to(q.dtype)
            self._positions = positions  # held, so its address cannot be reused by a new step's tensor
        cos, sin = self._cos_sin
        if self.elementwise is not None:
            return self.elementwise.rotate_half(q, cos, sin), self.elementwise.rotate_half(k, cos, sin)
        return _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Hugging Face layout's rotation, as in ``shared/model.py``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def fuse_projections(model: DecoderModel) -> DecoderModel:
    """Rearrange a loaded model in place (see the module docstring); returns it."""
    for layer in model.layers:
        if not isinstance(layer.self_attn, FusedAttention):
            layer.self_attn = FusedAttention(layer.self_attn)
            layer.mlp = FusedMLP(layer.mlp)
    if not isinstance(model.rotary_emb, StepRotaryEmbedding):
        model.rotary_emb = StepRotaryEmbedding(model.rotary_emb)
    for parent in [model, *model.layers]:
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm:
                setattr(parent, name, StepRMSNorm(child))
    return use_linear_method(model)  # every projection behind the one linear seam (``linear.py``)


def use_elementwise_kernels(model: DecoderModel, kernels: ElementwiseKernels | None) -> DecoderModel:
    """Run the norms, the MLPs' activation and RoPE's rotation of a fused model through ``kernels``
    (None: the torch code again)."""
    for module in model.modules():
        if isinstance(module, (FusedMLP, StepRMSNorm, StepRotaryEmbedding)):
            module.elementwise = kernels
    return model
