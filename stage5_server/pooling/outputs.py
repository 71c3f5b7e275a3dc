"""What ``LLM.embed`` and ``LLM.score`` return, shaped as vLLM's.

vLLM: ``PoolingRequestOutput``, ``EmbeddingRequestOutput`` and ``ScoringRequestOutput`` in ``vllm/outputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
