"""A request inside stage 5's engine core: stage 4's, plus what stage 5's systems attach to it.

- ``lora_request``: the adapter it runs under (``lora/``); None: the base model;
- ``mm_features``: the images in its prompt, each with its placeholder span and hash (``multimodal/``);
- ``spec_token_ids``: draft tokens its next decode verifies (``spec_decode/``);
- ``pooled_output``: a pooling runner's vector, set as it finishes (``pooling/``);
- ``kv_transfer_params``: ``{"transfer_id": ...}`` when its blocks cross between a prefill and a decode
  instance (``kv_transfer/p2p.py``); None otherwise.

The engine core makes one from each ``EngineCoreRequest`` it receives (``core/messages.py``).

vLLM: ``vllm/v1/request.py`` (``Request``: ``lora_request``, ``mm_features``, ``spec_token_ids``,
``kv_transfer_params``).
"""

from __future__ import annotations

from typing import Any

from shared.request import Request as _Request


class Request(_Request):
    def __init__(self, *args: Any, lora_request: Any = None, mm_features: list | None = None,
                 kv_transfer_params: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lora_request = lora_request
        self.kv_transfer_params = kv_transfer_params
        self.mm_features = list(mm_features or ())
        self.spec_token_ids: list[int] = []
        self.pooled_output: list[float] | None = None
