"""The request bodies of the pooling routes, in vLLM's shapes (strict: an unknown field is a 400).

vLLM: ``EmbeddingCompletionRequest``, ``ScoreRequest`` and ``RerankRequest`` in
``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stage5_server.server.protocol import StrictModel

TextOrIds = str | list[int]


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    def inputs(self) -> list[TextOrIds]:
        """The prompts: one text, texts, one list of token ids, or lists of them."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]
        return list(given)


class ScoreRequest(StrictModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None
