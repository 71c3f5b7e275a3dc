"""``POST /v2/embed``: Cohere's embed API (v2), as vLLM serves it, behind the API key like every route.

``texts`` in (at most ``--max-prompts-per-request``, each within ``max_model_len`` unless truncated), one
vector per text for each of ``embedding_types`` out: ``float``, ``base64`` (little-endian float32 bytes),
``binary`` and ``ubinary`` (one bit per dimension, 1 where the value is not negative, eight to a byte,
the first dimension in the highest bit; ``binary`` as signed bytes). ``truncate`` ``END`` (the default)
keeps a text's first ``max_tokens`` tokens (or the first ``max_model_len``), ``START`` its last ones,
``NONE`` refuses a longer text. ``input_type`` picks the model's own prompt prefix where its files define
one, and is refused where they define none, as in vLLM (``config/pooler.py``). The answer:
``{"id", "embeddings": {type: [...]}, "texts", "meta": {"api_version", "tokens": {"input_tokens"}}}``.

vLLM: ``vllm/entrypoints/pooling/embed/cohere/serving.py``, ``protocol.py`` (``build_typed_embeddings``) and
``api_router.py``.
"""

from __future__ import annotations

import uuid
from functools import cache
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from stage5_server.config.pooler import input_type_prompts
from stage5_server.server.errors import APIError
from stage5_server.server.pooling import PoolingServing, encode, usage
from stage5_server.server.pooling_protocol import CohereEmbedRequest
from stage5_server.server.serving import OpenAIServing


def typed_embeddings(vectors: list[list[float]], kind: str) -> list:
    """The vectors as one of Cohere's embedding types (``float``, ``base64``, ``binary``, ``ubinary``)."""
    if kind == "float":
        return vectors
    if kind == "base64":
        return [encode(v, "base64") for v in vectors]
    if len(vectors[0]) % 8:
        raise APIError(400, f"embedding_types: {kind} packs 8 dimensions a byte; this model's {len(vectors[0])} "
                       "are not a multiple of 8", param="embedding_types")
    packed = np.packbits(np.asarray(vectors) >= 0, axis=-1)  # the first dimension in the highest bit
    return (packed.astype(np.int16) - 128 if kind == "binary" else packed).tolist()


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    pooling = PoolingServing(serving)
    prompts = cache(lambda: input_type_prompts(serving.engine.model_path))  # read once, when first asked for

    @app.post("/v2/embed", summary="Cohere's embed API (v2): texts in, vectors by embedding type out")
    async def cohere_embed(request: Request, body: CohereEmbedRequest) -> dict[str, Any]:
        salt = pooling.admit(request, body.model, "Embeddings")
        if body.output_dimension is not None:
            raise APIError(400, pooling.no_matryoshka, param="output_dimension")
        pooling.check_count(len(body.texts), "texts")
        prefix = ""
        if body.input_type is not None:
            if body.input_type not in prompts():
                known = ", ".join(sorted(prompts())) or "none: this model defines no input_type prompts"
                raise APIError(400, f"input_type: {body.input_type!r} is not one of this model's ({known})",
                               param="input_type")
            prefix = prompts()[body.input_type]
        max_len = serving.engine.max_model_len
        if body.max_tokens is not None and body.max_tokens > max_len:
            raise APIError(400, f"max_tokens: at most max_model_len={max_len}, got {body.max_tokens}",
                           param="max_tokens")
        truncate = None if body.truncate == "NONE" else (body.max_tokens or -1)
        request_id = f"embd-{uuid.uuid4().hex}"
        results = await pooling.embed(request, [prefix + text for text in body.texts], truncate, salt, request_id,
                                      ["texts"] * len(body.texts), keep_last=body.truncate == "START")
        for i, (ids, _) in enumerate(results):
            if body.truncate == "NONE" and body.max_tokens is not None and len(ids) > body.max_tokens:
                raise APIError(400, f"texts[{i}]: {len(ids)} tokens exceed max_tokens={body.max_tokens} with "
                               "truncate=NONE; set truncate to END or START to allow truncation",
                               param=f"texts[{i}]")
        vectors = [vector for _, vector in results]
        return {"id": request_id,
                "embeddings": {kind: typed_embeddings(vectors, kind) for kind in body.embedding_types or ["float"]},
                "texts": body.texts,
                "meta": {"api_version": {"version": "2"}, "tokens": {"input_tokens": usage(results)["prompt_tokens"]}}}
