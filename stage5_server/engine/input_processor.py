"""``InputProcessor``: a prompt and its sampling parameters -> the engine requests the core will run.

Everything the front end checks or computes before a request is queued happens here, once:

    render a conversation (chat template) or tokenize text -> expand image placeholders, prepare
    the images -> check ids and lengths -> tokenize ``bad_words`` -> check structured outputs
    -> one EngineCoreRequest, or n children

Images come loaded (``multi_modal_data``: the API server fetched them under its media rules); here
they become placeholder tokens and pixels (``multimodal/processor.py``).

A length error is a ``ContextLengthExceeded`` (a ``ValueError`` naming ``prompt`` or ``max_tokens``),
worded as vLLM's, which the server answers with ``code: context_length_exceeded``. With ``n > 1``
the request fans out into children (``shared/parallel_sampling.py``); the core only ever sees ``n = 1``.

vLLM: ``vllm/v1/engine/input_processor.py`` (``processor.py`` in older versions).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from shared.llm_base import PromptType, check_inputs
from shared.parallel_sampling import ParentRequest
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from stage5_server.core.errors import ContextLengthExceeded
from stage5_server.core.messages import EngineCoreRequest
from stage5_server.lora.request import LoRARequest
from stage5_server.multimodal.processor import ImageProcessor, images_of


class InputProcessor:
    """Runs on the caller's thread, under the front end's tokenizer lock."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: Sequence[int],
                 image_processor: ImageProcessor | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor  # None: the model takes no images
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams, *, priority: int = 0,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                       ) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
        """The checked engine requests for one prompt: ``(None, [request])``, or ``(parent, its n children)``.
        ``prompt``: text, token ids, ``{"prompt": ...}``, ``{"prompt_token_ids": ...}``, or
        ``{"messages": [...], **apply_chat_template's keyword arguments}``; any of the dicts may add
        ``multi_modal_data: {"image": [PIL images]}`` (one image token per image in the prompt) and
        ``mm_processor_kwargs`` (the image processor's keyword arguments)."""
        images, processor_kwargs = None, None
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            images = images_of(prompt["multi_modal_data"])
            processor_kwargs = prompt.get("mm_processor_kwargs")
            prompt = {k: v for k, v in prompt.items() if k not in ("multi_modal_data", "mm_processor_kwargs")}
        if isinstance(prompt, dict) and "messages" in prompt:
            render = {k: v for k, v in prompt.items() if k != "messages"}
            prompt = self.tokenizer.apply_chat_template(prompt["messages"], True, **render)
        token_ids, bad_words = check_inputs(prompt, params, self.tokenizer, self.vocab_size, max_model_len=None)
        features = []
        if images is not None:
            if self.image_processor is None:
                raise ValueError("multi_modal_data: this model takes no images (it is not a vision-language model)")
            token_ids, features = self.image_processor.process(token_ids, images, processor_kwargs)
        self.check_lengths(len(token_ids), params.max_tokens,  # vLLM's messages, not ``prompt_token_ids``'s
                           params.min_tokens)
        now = time.monotonic()

        def make(rid: str, child_params: SamplingParams) -> EngineCoreRequest:
            return EngineCoreRequest(request_id=rid, prompt_token_ids=token_ids, sampling_params=child_params,
                                     arrival_time=now, priority=priority, cache_salt=cache_salt,
                                     eos_token_ids=self.eos_token_ids, bad_words_token_ids=bad_words,
                                     mm_features=features, lora_request=lora_request)

        if params.n == 1:
            return None, [make(request_id, params)]
        parent = ParentRequest(request_id, params)
        return parent, [make(cid, parent.child_params(i)) for i, cid in enumerate(parent.child_ids)]

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
