"""The layers that split one weight matrix across ranks, and where the ranks talk (Megatron-LM's split).

Both linear kinds are ``model/linear.py``'s ``Linear`` (one ``LinearMethod`` seam for every
product). ``ColumnParallelLinear`` splits the *output* features (q/k/v by head, gate/up by column): each
rank computes whole heads with no talk. ``RowParallelLinear`` splits the *input* features: one
``all_reduce`` adds the ranks' partial sums (after ``o_proj`` and ``down_proj``).
``VocabParallelEmbedding`` holds a slice of the vocabulary (zeros outside it, then an all-reduce);
``ParallelLMHead`` computes its slice's logits, joined by an all-gather. ``load_shard`` reads a
layer's own slice of the checkpoint's tensor.

vLLM: ``vllm/model_executor/layers/linear.py`` and ``vocab_parallel_embedding.py``; nano-vllm:
``layers/linear.py``, ``layers/embed_head.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stage5_server.model.linear import Linear
from stage5_server.parallel.parallel_state import all_gather, all_reduce


class _ShardLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, start: int):
        super().__init__(in_features, out_features, bias=bias)
        self.start = start  # where this rank's shard starts in the full weight


class ColumnParallelLinear(_ShardLinear):
    """Output rows ``[start, start + out_features)`` of the full weight (and bias)."""

    def load_shard(self, name: str, full) -> torch.Tensor:
        return full[self.start:self.start + self.out_features]  # weight [out, in] and bias [out] alike


class RowParallelLinear(_ShardLinear):
    """Input columns ``[start, start + in_features)`` of the full weight; the outputs are summed."""

    def load_shard(self, name: str, full) -> torch.Tensor:
        if name == "bias":
            return full[:]  # added once, after the sum
        return full[:, self.start:self.start + self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self.method.apply(self, x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + num_embeddings)`` of the vocabulary, zero-padded past ``vocab_size``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, vocab_size: int):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start
        self.vocab_size = vocab_size

    def load_shard(self, name: str, full) -> torch.Tensor:
        end = min(self.start + self.num_embeddings, self.vocab_size)
        rows = full[self.start:end]
        padding = self.num_embeddings - rows.shape[0]
        return F.pad(rows, (0, 0, 0, padding)) if padding else rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(hidden.masked_fill(outside[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over this rank's vocabulary slice; logits are gathered on every rank."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather(F.linear(hidden, self.weight), dim=-1)
        return logits[..., :self.vocab_size]  # drop the padding rows
