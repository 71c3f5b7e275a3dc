"""``InputProcessor``: a prompt and its sampling parameters -> the engine requests the core will run.

The only place a prompt becomes engine requests, for the offline ``LLM`` and for the server alike:

    render a conversation (chat template), images in it as image tokens; or tokenize text
    -> expand each image token to its placeholders, prepare the pixels -> check ids and lengths
    -> tokenize ``bad_words`` -> check structured outputs and the adapter
    -> one EngineCoreRequest, or n children

Images come loaded: as ``multi_modal_data`` beside a prompt (vLLM's offline form), or as content parts
of the messages (``image_pil``, or an ``image_url`` holding a ``data:`` URL; the API server fetches
http(s) URLs under its media rules before the request gets here: ``server/media.py``). Here they
become placeholder tokens and pixels (``multimodal/processor.py``).

A prompt must leave room to generate within ``max_model_len``. For the server (``check_max_tokens``)
``max_tokens`` must fit too, as vLLM's server asks: a length error is then a ``ContextLengthExceeded``
(a ``ValueError`` naming ``prompt`` or ``max_tokens``), worded as vLLM's, which the server answers with
``code: context_length_exceeded``; offline, a request simply stops at ``max_model_len``. With ``n > 1``
the request fans out into children (``shared/parallel_sampling.py``); the core only ever sees ``n = 1``.
A pooling model's input is token ids checked by the pooling room (``pooling_request``).

vLLM: ``vllm/v1/engine/input_processor.py`` (``processor.py`` in older versions).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from shared.llm_base import PromptType, check_inputs, check_prompt_fits
from shared.parallel_sampling import ParentRequest
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from stage5_server.core.messages import EngineCoreRequest
from stage5_server.errors import ContextLengthExceeded
from stage5_server.lora.request import LoRARequest
from stage5_server.multimodal.processor import ImageProcessor, images_of, load_offline_part, split_image_parts

NO_IMAGES = "this model takes no images (it is not a vision-language model)"


TRANSFER_ID = re.compile(r"^[A-Za-z0-9_-]{16,128}$")


def check_kv_transfer_params(params: Any) -> dict[str, str] | None:
    """None, or ``{"transfer_id": 16 to 128 letters, digits, '-' or '_'}``; a ValueError naming the field."""
    if params is None:
        return None
    if not isinstance(params, dict) or set(params) != {"transfer_id"} or not isinstance(params["transfer_id"], str) \
            or not TRANSFER_ID.match(params["transfer_id"]):
        raise ValueError("kv_transfer_params: expected {\"transfer_id\": 16 to 128 letters, digits, '-' or '_'}")
    return dict(params)


class InputProcessor:
    """Runs on the caller's thread (the server's: a worker thread, under the front end's tokenizer lock)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: Sequence[int],
                 image_processor: ImageProcessor | None = None, enable_lora: bool = False,
                 check_max_tokens: bool = True):
        self.tokenizer = tokenizer
        self.image_processor = image_processor  # None: the model takes no images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.enable_lora = enable_lora
        self.check_max_tokens = check_max_tokens  # the server's rule: prompt + max_tokens fit in max_model_len

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams, *, priority: int = 0,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                       ) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
        """The checked engine requests for one prompt: ``(None, [request])``, or ``(parent, its n children)``.
        ``prompt``: text, token ids, ``{"prompt": ...}``, ``{"prompt_token_ids": ...}``, or
        ``{"messages": [...], **apply_chat_template's keyword arguments}``; any of the dicts may add
        ``multi_modal_data: {"image": [PIL images]}`` (one image token per image in the prompt),
        ``mm_processor_kwargs`` (the image processor's keyword arguments) and ``kv_transfer_params``
        (``{"transfer_id": ...}``: the id its blocks cross between a prefill and a decode instance under)."""
        if lora_request is not None and not self.enable_lora:
            raise ValueError("lora_request: this engine serves no adapters; start it with enable_lora=True")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: must be a stage5_server.lora.LoRARequest, got {lora_request!r}")
        images, processor_kwargs, transfer = None, None, None
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:
                images = images_of(prompt["multi_modal_data"])
            processor_kwargs = prompt.get("mm_processor_kwargs")
            transfer = check_kv_transfer_params(prompt.get("kv_transfer_params"))
            prompt = {k: v for k, v in prompt.items()
                      if k not in ("multi_modal_data", "mm_processor_kwargs", "kv_transfer_params")}
        if isinstance(prompt, dict) and "messages" in prompt:
            prompt, in_messages = self.render(prompt)
            if in_messages:
                images = (images or []) + in_messages
        token_ids, bad_words = check_inputs(prompt, params, self.tokenizer, self.vocab_size, max_model_len=None)
        features = []
        if images is not None:
            if self.image_processor is None:
                raise ValueError(f"multi_modal_data: {NO_IMAGES}")
            token_ids, features = self.image_processor.process(token_ids, images, processor_kwargs)
        if self.check_max_tokens:
            self.check_lengths(len(token_ids), params.max_tokens, params.min_tokens)  # vLLM's messages
        else:
            check_prompt_fits(len(token_ids), self.max_model_len)
        now = time.monotonic()

        def make(rid: str, child_params: SamplingParams) -> EngineCoreRequest:
            return EngineCoreRequest(request_id=rid, prompt_token_ids=token_ids, sampling_params=child_params,
                                     arrival_time=now, priority=priority, cache_salt=cache_salt,
                                     eos_token_ids=self.eos_token_ids, bad_words_token_ids=bad_words,
                                     mm_features=features, lora_request=lora_request,
                                     kv_transfer_params=transfer)

        if params.n == 1:
            return None, [make(request_id, params)]
        parent = ParentRequest(request_id, params)
        return parent, [make(cid, parent.child_params(i)) for i, cid in enumerate(parent.child_ids)]

    def render(self, prompt: dict) -> tuple[list[int], list]:
        """A conversation's token ids, each image part rendered as the image token; and the images, in order."""
        messages, images = self._split_images(prompt["messages"], load_offline_part)
        render = {k: v for k, v in prompt.items() if k != "messages"}
        add_generation_prompt = render.pop("add_generation_prompt", True)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **render), images

    def tokenize_messages(self, messages: list[dict], add_generation_prompt: bool = True,
                          **render: object) -> list[int]:
        """What ``/tokenize`` shows of a conversation: its token ids with each image's placeholders (the
        images themselves are not needed to count them)."""
        messages, _ = self._split_images(messages, lambda part: None)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **render)
        return ids if self.image_processor is None else self.image_processor.expand(ids)

    def _split_images(self, messages: list[dict], load: Callable[[dict], Any]) -> tuple[list[dict], list]:
        """The messages with each image part as the template's image token, and ``load(part)`` of each part. A
        text model's messages pass as they are, unless a message's content parts hold anything but text."""
        if self.image_processor is not None:
            return split_image_parts(messages, load)
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ValueError(f"messages[{i}].content: {NO_IMAGES}; send text parts only")
        return messages, []

    def pooling_request(self, request_id: str, token_ids: list[int], cache_salt: str | None = None,
                        ) -> EngineCoreRequest:
        """A pooling model's request: checked token ids (``pooling/offline.py``'s ``pooling_token_ids``),
        sampling nothing (its parameters are carried, never used)."""
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=token_ids,
                                 sampling_params=SamplingParams(max_tokens=1), arrival_time=time.monotonic(),
                                 cache_salt=cache_salt)

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int | None, min_tokens: int = 0) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ContextLengthExceeded("prompt", f"This model's maximum context length is {limit} tokens. However, "
                                        f"your request has {num_prompt_tokens} input tokens, which leaves no room to "
                                        f"generate. Please reduce the length of the input.")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded("max_tokens", f"'max_tokens' is too large: {max_tokens}. This model's "
                                        f"maximum context length is {limit} tokens and your request has "
                                        f"{num_prompt_tokens} input tokens ({max_tokens} > {limit} - "
                                        f"{num_prompt_tokens}).")
        room = limit - num_prompt_tokens  # vLLM's default max_tokens: what the context has left
        if max_tokens is None and min_tokens > room:
            raise ValueError(f"min_tokens: must be less than or equal to max_tokens={room} (the context has room "
                             f"for {room} more tokens after the prompt's {num_prompt_tokens}), got {min_tokens}")
