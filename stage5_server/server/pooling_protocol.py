"""The request bodies of the pooling routes, in vLLM's shapes (a field inside an object is strict; the top level
follows ``request_fields.py``).

vLLM: ``EmbeddingCompletionRequest``, ``PoolingCompletionRequest``, ``ScoreRequest`` and ``RerankRequest`` in
``vllm/entrypoints/pooling/{embed,pooling,score}/protocol.py`` (``vllm/entrypoints/openai/protocol.py`` in older
releases), and ``CohereEmbedRequest`` in ``vllm/entrypoints/pooling/embed/cohere/protocol.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

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


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``POST /pooling``: the same inputs, the model's raw pooled output (an embedding model's vector)."""


# The names a score request may give its two sides, vLLM's newest first; one pair per request.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(StrictModel):
    model: str | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = [name for name in ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")
                 if getattr(self, name) is not None]
        for first, second in SCORE_SIDES:
            if set(given) == {first, second}:
                return self
        for first, second in SCORE_SIDES:  # half a pair: name what it lacks
            if given and set(given) <= {first, second}:
                missing = second if first in given else first
                raise ValueError(f"{missing}: Field required (with {given[0]})")
        if not given:
            raise ValueError("text_1: Field required (send text_1 and text_2, data_1 and data_2, or queries and "
                             "documents)")
        raise ValueError(f"{given[-1]}: send one pair of fields (text_1 and text_2, data_1 and data_2, queries and "
                         f"documents, or queries and items), got {', '.join(given)}")

    def sides(self) -> tuple[tuple[str, str | list[str]], tuple[str, str | list[str]]]:
        """``((name, value), (name, value))`` of the pair the request gave."""
        for first, second in SCORE_SIDES:
            if getattr(self, first) is not None and getattr(self, second) is not None:
                return (first, getattr(self, first)), (second, getattr(self, second))
        raise AssertionError("validated: one pair is given")


class RerankRequest(StrictModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None


# Cohere's embedding types: vLLM returns these four (int8 and uint8 need a model's own calibrated quantization).
COHERE_EMBEDDING_TYPES = ("float", "binary", "ubinary", "base64")


class CohereEmbedRequest(StrictModel):
    """Cohere's ``POST /v2/embed``, as vLLM serves it: ``texts`` in, one vector per text per embedding type out."""

    model: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None  # accepted only empty: this server's embedding models read text
    inputs: list[dict] | None = None
    input_type: str | None = None  # a prompt prefix, where the model's sentence-transformers files define one
    embedding_types: list[str] | None = None  # default ["float"]
    output_dimension: int | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0

    @field_validator("embedding_types")
    @classmethod
    def _types(cls, value: list[str] | None) -> list[str] | None:
        for i, kind in enumerate(value or []):
            if kind not in COHERE_EMBEDDING_TYPES:
                extra = (" (int8 and uint8 need a model's own calibrated quantization; vLLM does not return them "
                         "either)") if kind in ("int8", "uint8") else ""
                raise ValueError(f"embedding_types[{i}]: {kind!r} is not one of {', '.join(COHERE_EMBEDDING_TYPES)}"
                                 + extra)
        if value is not None and not value:
            raise ValueError("embedding_types: an empty list; leave it out for float")
        return value

    @model_validator(mode="after")
    def _text_only(self) -> CohereEmbedRequest:
        for name in ("images", "inputs"):
            if getattr(self, name):
                raise ValueError(f"{name}: this server's embedding models read text; send texts")
        if self.texts is None:
            raise ValueError("texts: Field required (a list of texts to embed)")
        if self.priority != 0:
            raise ValueError("priority: this server serves pooling requests first come, first served (only 0)")
        return self
