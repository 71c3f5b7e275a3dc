"""A linear layer that adds each token's own adapter: ``out = x @ W.T + (x @ A_s.T) @ B_s.T * scale_s``.

One step mixes requests for different adapters and for the base model, so the delta cannot be one
matrix multiply: token row ``t`` needs the ``A`` and ``B`` of its own slot ``s(t)``. The step's
``LoRAMapping`` (filled by ``manager.py`` before the forward, from the scheduled requests) lists,
per slot in use, the token rows that use it. ``LoRALinearMethod`` computes the base product with
the layer's own method (plain, packed or quantized), then for each slot gathers its rows, shrinks
them to rank ``r`` (``x @ A.T``), expands them back (``@ B.T``), scales, and adds the result into
those rows only: one pair of small GEMMs per adapter in the step, Punica's segmented SGMV, written
as torch ops. Rows without an adapter are never written, so the base model's tokens come out bit
for bit as without LoRA.

A fused layer (``qkv_proj``, ``gate_up_proj``) holds one output slice per projection: PEFT adapts
q, k and v (gate and up) each with its own ``A`` and ``B``. The shrink runs once on the slices'
stacked ``A`` (``[slices * r, in]``); each slice expands its own columns of the output.

vLLM: ``vllm/lora/layers/`` (``ColumnParallelLinearWithLoRA``, ``MergedQKVParallelLinearWithLoRA``,
``RowParallelLinearWithLoRA``) over ``vllm/lora/punica_wrapper/punica_cpu.py`` (``add_shrink``,
``add_expand``: the same loop over segments, written in torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from stage5_server.model.linear import Linear, LinearMethod


@dataclass
class LoRAMapping:
    """This step's token rows per adapter slot: ``segments`` holds ``(slot, rows)`` for every slot in
    use, ``rows`` a tensor of token indices, or None when the slot covers every token of the step."""

    segments: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    scalings: list[float] = field(default_factory=list)  # per slot


@dataclass
class SlotWeights:
    """One adapter's weights in one layer: stacked ``A`` of every slice, and each slice's ``B``
    (None where the adapter leaves that projection alone)."""

    a: torch.Tensor  # [slices * rank, in]
    b: list[torch.Tensor | None]  # per slice: [out of the slice, rank]
    rank: int


class LoRALinearMethod(LinearMethod):
    """The layer's own method, plus each token's adapter delta (module docstring)."""

    def __init__(self, base: LinearMethod, slice_sizes: list[int], mapping: LoRAMapping, max_loras: int):
        self.base = base
        self.slice_bounds = []
        start = 0
        for size in slice_sizes:
            self.slice_bounds.append((start, start + size))
            start += size
        self.mapping = mapping  # shared by every layer; the manager refills it each step
        self.slots: list[SlotWeights | None] = [None] * max_loras

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass  # the base method has processed the layer's weights already

    def describe(self, layer: Linear) -> str:
        return f"{self.base.describe(layer)} + LoRA"

    def weight_bytes(self, layer: Linear) -> int:
        return self.base.weight_bytes(layer)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self.base.apply(layer, x, bias)
        for slot, rows in self.mapping.segments:
            weights = self.slots[slot]
            if weights is None:
                continue  # this adapter leaves the layer alone
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = F.linear(xs, weights.a)  # [tokens, slices * rank]
            scaling, rank = self.mapping.scalings[slot], weights.rank
            for j, ((lo, hi), b) in enumerate(zip(self.slice_bounds, weights.b)):
                if b is None:
                    continue
                delta = F.linear(shrunk[:, j * rank:(j + 1) * rank], b) * scaling  # PEFT's order of operations
                target = out if len(self.slice_bounds) == 1 else out[:, lo:hi]
                if rows is None:
                    target += delta
                else:
                    target.index_add_(0, rows, delta)
        return out

    def set_slot(self, slot: int, weights: SlotWeights | None) -> None:
        self.slots[slot] = weights
