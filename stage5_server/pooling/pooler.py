"""The pooler: a prompt's final hidden states -> one vector (mean, first token or last token), normalized
when the checkpoint says so. A decoder's prompt may arrive over several steps (chunked prefill), so the
pooler keeps a running sum, the first row and the last row per request until its prompt is complete.

vLLM: ``MeanPool``, ``CLSPool``, ``LastPool`` and the normalizing ``PoolerNormalize`` in
``vllm/model_executor/layers/pooler.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stage5_server.config.pooler import PoolerConfig


@dataclass
class PartialPool:
    """One request's prompt so far."""

    total: torch.Tensor | None = None  # MEAN: the sum of the rows seen
    first: torch.Tensor | None = None  # CLS: row 0
    last: torch.Tensor | None = None  # LAST: the latest row
    num_rows: int = 0


class Pooler:
    def __init__(self, config: PoolerConfig):
        self.config = config
        self.partial: dict[str, PartialPool] = {}

    def pool_padded(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``hidden [batch, seq, dim]`` of whole prompts right-padded to ``seq``; ``lengths [batch]``."""
        kind = self.config.pooling_type
        if kind == "CLS":
            pooled = hidden[:, 0]
        elif kind == "LAST":
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        else:
            mask = (torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None])
            mask = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # as sentence-transformers divides
        return self.finish(pooled)

    def add_rows(self, request_id: str, rows: torch.Tensor, start: int) -> None:
        """Rows ``start ..`` of a request's prompt (a chunk); ``start == 0`` begins it again (a preempted
        request is recomputed from its first token)."""
        part = self.partial.get(request_id)
        if part is None or start == 0:
            part = self.partial[request_id] = PartialPool()
        rows = rows.float()
        if start == 0:
            part.first = rows[0]
        total = rows.sum(0)
        part.total = total if part.total is None else part.total + total
        part.last = rows[-1]
        part.num_rows = start + rows.shape[0]

    def take(self, request_id: str) -> torch.Tensor:
        """The request's pooled vector, once its whole prompt has been added; forgets the request."""
        part = self.partial.pop(request_id)
        kind = self.config.pooling_type
        pooled = part.first if kind == "CLS" else part.last if kind == "LAST" else part.total / part.num_rows
        return self.finish(pooled[None])[0]

    def forget(self, request_id: str) -> None:
        self.partial.pop(request_id, None)

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        pooled = pooled.float()
        return F.normalize(pooled, p=2, dim=-1) if self.config.normalize else pooled
