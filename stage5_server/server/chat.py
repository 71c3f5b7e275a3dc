"""``POST /v1/chat/completions``: messages rendered with the model's chat template, then generated.

vLLM: ``vllm/entrypoints/openai/serving_chat.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from shared.outputs import Logprob, RequestOutput
from stage5_server.server.completions import token_text
from stage5_server.server.protocol import ChatCompletionRequest
from stage5_server.server.serving import OpenAIServing, Responder, finish_reason


def chat_logprobs(output: RequestOutput, start: int, end: int, top_n: int) -> dict[str, Any] | None:
    """The chat format: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    completion = output.outputs[0]
    if completion.logprobs is None:
        return None

    def item(lp: Logprob) -> dict[str, Any]:
        token = token_text(lp)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for token_id, entry in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
        chosen = entry[token_id]  # the sampler always records the sampled token
        top = sorted((lp for lp in entry.values() if lp.rank <= top_n), key=lambda x: x.rank)
        content.append({**item(chosen), "top_logprobs": [item(lp) for lp in top]})
    return {"content": content}


class ChatResponder(Responder):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args: Any, top_logprobs: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.top_logprobs = top_logprobs
        self.started: set[int] = set()  # choices whose first delta (carrying the role) went out

    def choice(self, index: int, output: RequestOutput) -> dict[str, Any]:
        c = output.outputs[0]
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(output, 0, len(c.token_ids), self.top_logprobs),
                "finish_reason": finish_reason(output), "stop_reason": c.stop_reason}

    def chunk(self, index: int, output: RequestOutput, text: str, start: int, end: int) -> dict[str, Any]:
        first = index not in self.started
        self.started.add(index)
        delta: dict[str, Any] = {"content": text} if text or first else {}
        if first:
            delta = {"role": "assistant", **delta}
        finished = output.finished
        choice = {"index": index, "delta": delta,
                  "logprobs": chat_logprobs(output, start, end, self.top_logprobs),
                  "finish_reason": finish_reason(output) if finished else None,
                  "stop_reason": output.outputs[0].stop_reason if finished else None}
        return self.chunk_body(output, choice)


async def create_chat_completion(serving: OpenAIServing, request: Request, body: ChatCompletionRequest) -> Response:
    salt = serving.admit(request, body.model, body.cache_salt)
    params = body.sampling_params(body.requested_max_tokens, body.num_logprobs)
    token_ids = await serving.on_engine(serving.engine.tokenizer.apply_chat_template, body.conversation())
    serving.check_lengths(len(token_ids), params.max_tokens, "messages")
    responder = ChatResponder(f"chatcmpl-{uuid.uuid4().hex}", serving.served_model_name, request, body.include_usage,
                              body.continuous_usage, n=params.n, top_logprobs=body.top_logprobs or 0)
    return await serving.generate(request, [token_ids], params, salt, responder, body.stream)


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(serving, request, body)
