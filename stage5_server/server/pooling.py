"""The pooling routes: ``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` (with vLLM's unprefixed ``/score``
and ``/rerank`` and its ``/v2/rerank``), every one behind the API key like the rest of the server.

A request holds at most ``--max-prompts-per-request`` inputs (each is an engine request). Each input is
tokenized and checked (``pooling/offline.py``: longer than ``max_model_len`` is a 400 unless
``truncate_prompt_tokens``; an empty text is a 400, as in OpenAI's API), sent as one pooling request
(``AsyncEngine.add_pooling_request``), and its vector comes back with the request's final output. A score
is the cosine similarity of two embeddings (an embedding model's score, as vLLM computes it for a
bi-encoder); rerank sorts the documents by it. A generating model asked for any of these gets vLLM's
400, as a pooling model asked for tokens does (``serving.py``).

vLLM: ``vllm/entrypoints/openai/serving_embedding.py``, ``serving_score.py`` and the routes in ``api_server.py``.
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
from stage5_server.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest, TextOrIds
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
                    request_id: str, params: list[str]) -> list[tuple[list[int], list[float]]]:
        """``(token ids, vector)`` per prompt, in order; ``params[i]``: the field prompt i came from."""
        engine = self.engine
        if not prompts:
            raise APIError(400, "input: at least one input is needed", param="input")
        max_len, vocab = engine.max_model_len, engine.vocab_size
        all_ids = []
        for prompt, param in zip(prompts, params, strict=True):
            with engine_errors(param):
                all_ids.append(await engine.call(pooling_token_ids, prompt, engine.tokenizer, vocab, max_len, truncate,
                                                 param))
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

    @app.post("/v1/embeddings", summary="Embeddings (a pooling model)")
    async def embeddings(request: Request, body: EmbeddingRequest) -> dict[str, Any]:
        salt = pooling.admit(request, body.model, "Embeddings")
        if body.dimensions is not None:
            raise APIError(400, f'Model "{serving.served_model_name}" does not support matryoshka representation, '
                           "changing output dimensions will lead to poor results.", param="dimensions")
        request_id = f"embd-{uuid.uuid4().hex}"
        inputs = body.inputs()
        pooling.check_count(len(inputs), "input")
        results = await pooling.embed(request, inputs, body.truncate_prompt_tokens, salt, request_id,
                                      ["input"] * len(inputs))
        data = [{"index": i, "object": "embedding", "embedding": encode(vector, body.encoding_format)}
                for i, (_, vector) in enumerate(results)]
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": serving.served_model_name,
                "data": data, "usage": usage(results)}

    async def score(request: Request, body: ScoreRequest) -> dict[str, Any]:
        salt = pooling.admit(request, body.model, "Score")
        try:
            first, second = pair_up(body.text_1, body.text_2)
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).partition(":")[0]) from None
        pooling.check_count(len(second), "text_2")  # the pairs; text_1 has as many, or one repeated
        request_id = f"score-{uuid.uuid4().hex}"
        results = await pooling.embed(request, first + second, body.truncate_prompt_tokens, salt, request_id,
                                      ["text_1"] * len(first) + ["text_2"] * len(second))
        vectors = [vector for _, vector in results]
        scores = cosine_scores(vectors[:len(first)], vectors[len(first):])
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": serving.served_model_name,
                "data": data, "usage": usage(results)}

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
        return {"id": request_id, "model": serving.served_model_name, "usage": {"total_tokens": usage(results)[
            "total_tokens"]}, "results": ranked}

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
