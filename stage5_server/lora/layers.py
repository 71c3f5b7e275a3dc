"""A linear layer that adds each token's own adapter: ``out = x @ W.T + (x @ A_s.T) @ B_s.T * scale_s``.

One step mixes requests for different adapters and for the base model, so the delta cannot be one
matrix multiply: token row ``t`` needs the ``A`` and ``B`` of its own slot ``s(t)``. The step's
``LoRAMapping`` (filled by ``manager.py`` before the forward, from the scheduled requests) says
which rows use which slot. ``LoRALinearMethod`` computes the base product with the layer's own
method (plain, packed or quantized), then adds the deltas into the adapted rows only: a
**shrink** to rank ``r`` (``x @ A.T``), an **expand** back (``@ B.T``), the scaling, and an add.
Rows without an adapter are never written, so the base model's tokens come out bit for bit as
without LoRA.

- One adapter in the step: two plain GEMMs over its rows (all of them, or a gathered subset).
- Several: every slot's matrices also sit in one stacked tensor, zero-padded to
  ``max_lora_rank``, and the step's rows are laid out as ``[adapters, rows per adapter]``
  (padding rows repeat a real row, with scaling 0). Shrink and expand are then one batched matmul
  each (``torch.bmm``) and one ``index_add_`` puts the deltas back, however many adapters the
  step holds: the padded form of Punica's segmented SGMV.

A fused layer (``qkv_proj``, ``gate_up_proj``) holds one output slice per projection: PEFT adapts
q, k and v (gate and up) each with its own ``A`` and ``B``. The slices' ``A`` are stacked
(``[slices * r, in]``) and their ``B`` placed block-diagonally (slice ``j``'s ``B`` on its own
output columns and its own ``r`` inputs, zeros elsewhere), so one shrink and one expand serve
every slice. The zeros add nothing: only the order in which the real terms are summed changes.

vLLM: ``vllm/lora/layers/`` (``ColumnParallelLinearWithLoRA``, ``MergedQKVParallelLinearWithLoRA``,
``RowParallelLinearWithLoRA``) over ``vllm/lora/punica_wrapper/punica_cpu.py`` (``add_shrink``,
``add_expand``, written there as torch loops over the token-to-slot map).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from stage5_server.model.linear import Linear, LinearMethod


@dataclass
class LoRAMapping:
    """This step's token rows per adapter slot. ``segments``: ``(slot, rows)`` for every slot in
    use, ``rows`` a tensor of token indices, or None when the slot covers every token of the step;
    with several segments, the same rows padded into one batch (the ``padded_*`` fields)."""

    segments: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    scalings: list[float] = field(default_factory=list)  # per slot
    slots: torch.Tensor | None = None  # [adapters]: the slot of each segment, ascending
    padded_rows: torch.Tensor | None = None  # [adapters * rows per adapter]: token rows, padding repeats one
    padded_scaling: torch.Tensor | None = None  # [adapters, rows per adapter, 1]: the slot's scaling, 0 on padding


@dataclass
class SlotWeights:
    """One adapter's weights in one layer, every slice together (module docstring)."""

    a: torch.Tensor  # [slices * rank, in]: the slices' A, stacked
    b: torch.Tensor  # [out, slices * rank]: the slices' B, block-diagonal
    rank: int


class LoRALinearMethod(LinearMethod):
    """The layer's own method, plus each token's adapter delta (module docstring)."""

    def __init__(self, base: LinearMethod, slice_sizes: list[int], mapping: LoRAMapping, max_loras: int,
                 max_rank: int):
        self.base = base
        self.slice_sizes = slice_sizes
        self.mapping = mapping  # shared by every layer; the manager refills it each step
        self.max_rank = max_rank
        self.slots: list[SlotWeights | None] = [None] * max_loras
        self.stacked_a: torch.Tensor | None = None  # [max_loras, slices * max_rank, in], zero-padded
        self.stacked_b: torch.Tensor | None = None  # [max_loras, slices * max_rank, out], B transposed

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass  # the base method has processed the layer's weights already

    def describe(self, layer: Linear) -> str:
        return f"{self.base.describe(layer)} + LoRA"

    def weight_bytes(self, layer: Linear) -> int:
        return self.base.weight_bytes(layer)

    def row_split(self) -> int | None:
        return self.base.row_split()

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self.base.apply(layer, x, bias)
        mapping = self.mapping
        if mapping.padded_rows is not None:
            if self.stacked_a is not None:  # some adapter of the step adapts this layer
                self._add_padded(x, out)
        elif mapping.segments:
            slot, rows = mapping.segments[0]
            weights = self.slots[slot]
            if weights is not None:
                xs = x if rows is None else x.index_select(0, rows)
                delta = F.linear(F.linear(xs, weights.a), weights.b) * mapping.scalings[slot]  # PEFT's order
                if rows is None:
                    out += delta
                else:
                    out.index_add_(0, rows, delta)
        return out

    def _add_padded(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Every segment's delta at once: a gather, one ``bmm`` per half, one ``index_add_``."""
        mapping = self.mapping
        num_segments = mapping.slots.shape[0]
        every_slot = num_segments == self.stacked_a.shape[0]  # then the slots come in order: no gather
        a = self.stacked_a if every_slot else self.stacked_a.index_select(0, mapping.slots)
        b = self.stacked_b if every_slot else self.stacked_b.index_select(0, mapping.slots)
        xs = x.index_select(0, mapping.padded_rows).view(num_segments, -1, x.shape[1])
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b) * mapping.padded_scaling
        out.index_add_(0, mapping.padded_rows, delta.view(-1, out.shape[1]))

    def set_slot(self, slot: int, weights: SlotWeights | None) -> None:
        """Put ``weights`` (None: this adapter leaves the layer alone) in ``slot``."""
        self.slots[slot] = weights
        if weights is None and self.stacked_a is None:
            return
        if self.stacked_a is None:
            rows, in_features = len(self.slice_sizes) * self.max_rank, weights.a.shape[1]
            self.stacked_a = weights.a.new_zeros(len(self.slots), rows, in_features)
            self.stacked_b = weights.a.new_zeros(len(self.slots), rows, sum(self.slice_sizes))
        self.stacked_a[slot].zero_()
        self.stacked_b[slot].zero_()
        if weights is None:
            return
        r, rank = weights.rank, self.max_rank
        for j in range(len(self.slice_sizes)):  # slice j's r rows at j * max_rank
            self.stacked_a[slot, j * rank:j * rank + r] = weights.a[j * r:(j + 1) * r]
            self.stacked_b[slot, j * rank:j * rank + r] = weights.b[:, j * r:(j + 1) * r].T


def block_diagonal_b(bs: list[torch.Tensor | None], slice_sizes: list[int], rank: int) -> torch.Tensor:
    """The slices' B in one ``[out, slices * rank]`` matrix: slice j's rows and its rank's columns."""
    like = next(b for b in bs if b is not None)
    full = like.new_zeros(sum(slice_sizes), len(slice_sizes) * rank)
    start = 0
    for j, (b, size) in enumerate(zip(bs, slice_sizes)):
        if b is not None:
            full[start:start + size, j * rank:(j + 1) * rank] = b
        start += size
    return full
