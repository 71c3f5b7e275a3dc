"""The routes around generation: ``/v1/models`` (what is served: the base model and the LoRA
adapters the key's trust group may use, ``lora_models.py``) and vLLM's ``/tokenize`` and
``/detokenize`` (the exact token ids a prompt or a conversation becomes, and back), with their
two request models.

vLLM: ``vllm/entrypoints/openai/serving_models.py`` and ``serving_tokenization.py``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from pydantic import model_validator

from stage5_server.multimodal.processor import count_image_parts
from stage5_server.server.auth import trust_group
from stage5_server.server.media import check_image_count
from stage5_server.server.protocol import ChatMessage, StrictModel
from stage5_server.server.serving import OpenAIServing
from stage5_server.server.tool_protocol import ChatTool


class TokenizeRequest(StrictModel):
    """``POST /tokenize`` (vLLM's): either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # shown by the chat template, as a chat request's would be
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("prompt: send exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: only with messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    engine = serving.engine
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        # ``root``: what the model was loaded from (vLLM's bench reads it to find the tokenizer when no
        # --model is given); ``permission``: OpenAI's legacy field, in vLLM's shape.
        permission = {"id": f"modelperm-{serving.served_model_name}", "object": "model_permission",
                      "created": created, "allow_create_engine": False, "allow_sampling": True,
                      "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}
        return {"id": serving.served_model_name, "object": "model", "created": created, "owned_by": "stagedserve",
                "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len,
                "permission": [permission]}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": serving.models.cards(model_card(), trust_group(request))}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
        serving.check_model(model, request)
        return next(card for card in serving.models.cards(model_card(), trust_group(request)) if card["id"] == model)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        serving.check_model(body.model, request)
        tokenizer = engine.tokenizer
        if body.messages is not None:
            conversation = [m.as_template_message() for m in body.messages]
            check_image_count(serving.media.options, count_image_parts(conversation))  # as the real request
            control = serving.chat_options.control_tokens_in_messages  # as the real prompt would be
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await serving.on_engine(lambda: engine.input_processor.tokenize_messages(  # images as placeholders
                conversation, body.add_generation_prompt, tools=tools, control_tokens_in_messages=control))
        else:
            ids = await serving.on_engine(tokenizer.encode, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        serving.check_model(body.model, request)
        tokenizer = engine.tokenizer

        def decode(ids: list[int]) -> str:
            vocab = len(tokenizer.hf)
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"tokens: token ids must be in [0, {vocab})")
            return tokenizer.decode(ids)

        return {"prompt": await serving.on_engine(decode, body.tokens)}
