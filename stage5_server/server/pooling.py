"""The pooling routes: ``/v1/embeddings``, vLLM's ``/pooling``, ``/v1/score`` and ``/v1/rerank`` (with vLLM's
unprefixed ``/score`` and ``/rerank`` and its ``/v2/rerank``), every one behind the API key like the rest of the
server (Cohere's ``/v2/embed`` is ``cohere_embed.py``).

A request holds at most ``--max-prompts-per-request`` inputs (each is an engine request). Each input is
tokenized and checked (``pooling/offline.py``: longer than ``max_model_len`` is a 400 unless
``truncate_prompt_tokens``; an empty text is a 400, as in OpenAI's API), sent as one pooling request
(``AsyncEngine.add_pooling_request``), and its vector comes back with the request's final output. A score
is the cosine similarity of two embeddings (an embedding model's score, as vLLM computes it for a
bi-encoder); one text scored against many is embedded once, and its tokens counted once in ``usage``, as
vLLM does; rerank sorts the documents by it. A score request names its two sides as vLLM 0.32 does
(``queries`` and ``documents`` or ``items``, ``data_1`` and ``data_2``) or as before (``text_1`` and
``text_2``). ``/pooling`` answers with the vector the model pools, as vLLM's raw output. A generating model
asked for any of these gets vLLM's 400, as a pooling model asked for tokens does (``serving.py``).

vLLM: ``vllm/entrypoints/pooling/embed/serving.py``, ``pooling/serving.py`` and ``scoring/serving.py``
(``vllm/entrypoints/openai/serving_embedding.py``, ``serving_pooling.py`` and ``serving_score.py`` in older
releases) and the routes' ``api_router.py`` files.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from stage5_server.pooling.offline import cosine_scores, pair_up, pooling_token_ids
from stage5_server.server.auth import RECEIVED_SCOPE_KEY
from stage5_server.server.errors import APIError, engine_errors
from stage5_server.server.limits import FLAGS, RequestLimits
from stage5_server.server.pooling_protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TextOrIds,
)
from stage5_server.server.serving import OpenAIServing
from stage5_server.server.sse import final_output, unless_disconnected


class PoolingServing:
    def __init__(self, serving: OpenAIServing):
        self.serving, self.engine = serving, serving.engine

    def admit(self, request: Request, model: str | None, api: str) -> str:
        salt = self.serving.admit(request, model, None).cache_salt
        if not self.engine.is_pooling:
            raise APIError(400, f"The model does not support {api} API")
        return salt

    @property
    def no_matryoshka(self) -> str:
        """vLLM's refusal of ``dimensions``: this model was not trained to be cut short."""
        return (f'Model "{self.serving.served_model_name}" does not support matryoshka representation, changing '
                "output dimensions will lead to poor results.")

    def check_count(self, count: int, param: str) -> None:
        """At least one input, and no more than ``--max-prompts-per-request`` (each is an engine request)."""
        cap = self.serving.limits.max_prompts_per_request
        if count < 1:
            raise APIError(400, f"{param}: at least one input is needed", param=param)
        if count > cap:
            raise APIError(400, f"{param}: this request asks for {count} inputs; this server allows at most {cap} "
                           f"(its {FLAGS['max_prompts_per_request']} flag sets that cap, by default "
                           f"{RequestLimits.max_prompts_per_request}).", param=param, code="request_limit_exceeded")

    async def embed(self, request: Request, prompts: list[TextOrIds], truncate: int | None, salt: str,
                    request_id: str, params: list[str], keep_last: bool = False,
                    ) -> list[tuple[list[int], list[float]]]:
        """``(token ids, vector)`` per prompt, in order; ``params[i]``: the field prompt i came from;
        ``keep_last``: truncation keeps a text's last tokens."""
        engine = self.engine
        if not prompts:
            raise APIError(400, "input: at least one input is needed", param="input")
        max_len, vocab = engine.max_model_len, engine.vocab_size
        all_ids = []
        for prompt, param in zip(prompts, params, strict=True):
            with engine_errors(param):
                all_ids.append(await engine.call(pooling_token_ids, prompt, engine.tokenizer, vocab, max_len, truncate,
                                                 param, keep_last))
        streams = []
        try:
            for i, ids in enumerate(all_ids):
                with engine_errors(params[i]):
                    streams.append(await engine.add_pooling_request(
                        ids, f"{request_id}-{i}", cache_salt=salt, received_time=request.scope.get(RECEIVED_SCOPE_KEY)))
            with engine_errors(params[0]):
                outputs = await unless_disconnected(request, asyncio.gather(*map(final_output, streams)))
        except BaseException:
            engine.abort([s.request_id for s in streams])
            raise
        for output in outputs:
            if output.pooled is None:
                raise APIError(500, "The engine returned no vector for this input.", code="engine_error")
        return [(o.prompt_token_ids, o.pooled) for o in outputs]


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    pooling = PoolingServing(serving)

    async def vectors(request: Request, body: EmbeddingRequest, api: str, kind: str, prefix: str) -> dict[str, Any]:
        """``/v1/embeddings`` (``kind`` ``embedding``) and ``/pooling`` (``pooling``): a vector per input."""
        salt = pooling.admit(request, body.model, api)
        if body.dimensions is not None:
            raise APIError(400, pooling.no_matryoshka, param="dimensions")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        inputs = body.inputs()
        pooling.check_count(len(inputs), "input")
        results = await pooling.embed(request, inputs, body.truncate_prompt_tokens, salt, request_id,
                                      ["input"] * len(inputs))
        key = "embedding" if kind == "embedding" else "data"
        data = [{"index": i, "object": kind, key: encode(vector, body.encoding_format)}
                for i, (_, vector) in enumerate(results)]
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": serving.served_model_name,
                "data": data, "usage": usage(results)}

    @app.post("/v1/embeddings", summary="Embeddings (a pooling model)")
    async def embeddings(request: Request, body: EmbeddingRequest) -> dict[str, Any]:
        return await vectors(request, body, "Embeddings", "embedding", "embd")

    @app.post("/pooling", summary="vLLM's raw pooled output (an embedding model's vector)")
    async def pooled(request: Request, body: PoolingRequest) -> dict[str, Any]:
        return await vectors(request, body, "Pooling", "pooling", "pool")

    async def score(request: Request, body: ScoreRequest) -> dict[str, Any]:
        salt = pooling.admit(request, body.model, "Score")
        (name_1, given_1), (name_2, given_2) = body.sides()
        try:
            first, second = pair_up(given_1, given_2, (name_1, name_2))
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).partition(":")[0]) from None
        pooling.check_count(len(second), name_2)  # the pairs; the first side has as many, or one
        request_id = f"score-{uuid.uuid4().hex}"
        results = await pooling.embed(request, first + second, body.truncate_prompt_tokens, salt, request_id,
                                      [name_1] * len(first) + [name_2] * len(second))
        vectors_1 = [vector for _, vector in results[:len(first)]]
        vectors_2 = [vector for _, vector in results[len(first):]]
        scores = cosine_scores(vectors_1 * len(vectors_2) if len(vectors_1) == 1 else vectors_1, vectors_2)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": serving.served_model_name,
                "data": data, "usage": usage(results)}  # one text against many: embedded, and counted, once

    async def rerank(request: Request, body: RerankRequest) -> dict[str, Any]:
        salt = pooling.admit(request, body.model, "Rerank (Score)")
        request_id = f"rerank-{uuid.uuid4().hex}"
        if not body.documents:
            raise APIError(400, "documents: at least one document is needed", param="documents")
        pooling.check_count(len(body.documents), "documents")
        results = await pooling.embed(request, [body.query, *body.documents], body.truncate_prompt_tokens, salt,
                                      request_id, ["query"] + ["documents"] * len(body.documents))
        query, documents = results[0][1], [vector for _, vector in results[1:]]
        scores = cosine_scores([query] * len(documents), documents)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        top = order[:body.top_n] if body.top_n else order
        ranked = [{"index": i, "relevance_score": scores[i],
                   **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in top]
        tokens = usage(results)["prompt_tokens"]
        return {"id": request_id, "model": serving.served_model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": ranked}

    for path in ("/v1/score", "/score"):
        app.post(path, summary="Score pairs of texts: cosine similarity of their embeddings")(score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path, summary="Rank documents against a query (Jina / Cohere shape)")(rerank)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the numbers; ``base64``: their little-endian float32 bytes (what the openai client decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def usage(results: list[tuple[list[int], list[float]]]) -> dict[str, Any]:
    tokens = sum(len(ids) for ids, _ in results)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}
