"""``POST /v1/completions``: a prompt (text or token ids) continued, whole or streamed.

vLLM: ``vllm/entrypoints/openai/serving_completion.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from shared.outputs import Logprob, RequestOutput
from stage5_server.server.protocol import CompletionRequest
from stage5_server.server.serving import OpenAIServing, Responder, finish_reason


def token_text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""  # the front end decodes it


def completion_logprobs(output: RequestOutput, start: int, end: int, text_offset: int) -> dict[str, Any] | None:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        chosen = entry[token_id]  # the sampler always records the sampled token
        token = token_text(chosen)
        result["tokens"].append(token)
        result["token_logprobs"].append(chosen.logprob)
        result["top_logprobs"].append({token_text(lp): lp.logprob for lp in sorted(entry.values(),
                                                                                  key=lambda x: x.rank)})
        result["text_offset"].append(text_offset)
        text_offset += len(token)
    return result


class CompletionResponder(Responder):
    object = chunk_object = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.text_offset = 0  # characters streamed so far

    def response(self, output: RequestOutput) -> dict[str, Any]:
        c = output.outputs[0]
        choice = {"index": 0, "text": c.text, "logprobs": completion_logprobs(output, 0, len(c.token_ids), 0),
                  "finish_reason": finish_reason(output), "stop_reason": c.stop_reason}
        return self.whole(output, choice)

    def chunk(self, output: RequestOutput, text: str, start: int, end: int) -> dict[str, Any]:
        logprobs = completion_logprobs(output, start, end, self.text_offset)
        self.text_offset += len(text)
        choice = {"index": 0, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason(output) if output.finished else None}
        return self.chunk_body(output, choice)


async def create_completion(serving: OpenAIServing, request: Request, body: CompletionRequest) -> Response:
    salt = serving.admit(request, body.model, body.cache_salt)
    params = body.sampling_params(body.max_tokens, body.logprobs)
    prompt = body.prompt
    token_ids = prompt if isinstance(prompt, list) else await serving.on_engine(serving.engine.tokenizer.encode, prompt)
    serving.check_lengths(len(token_ids), params.max_tokens, "prompt")
    responder = CompletionResponder(f"cmpl-{uuid.uuid4().hex}", serving.served_model_name, request,
                                    body.include_usage)
    return await serving.generate(request, token_ids, params, salt, responder, body.stream)


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(serving, request, body)
