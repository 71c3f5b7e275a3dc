"""``LLM`` for stage5: the shared offline front end over an engine core built from one config.

Where stages 1-4 build their engine by subclassing the stage before, stage 5 builds it as vLLM V1
does: ``EngineConfig.create`` checks every argument once (``config.py``), ``build_engine_core``
starts the workers and sizes the KV cache (``core/builder.py``), and what is left here is the
offline API that every stage shares (``shared/llm_base.py``: generate, chat, abort, outputs).
The engine-core process and every data-parallel rank build their core with the same two calls.

New in stage 5 underneath: the attention-backend registry (``attention/``), CUDA by default when
present (bf16), a KV cache sized from free GPU memory, a persistent input batch (``worker/``), the
model rearranged for speed (``model/``), one torch thread per physical core on a CPU with
``dtype="auto"`` bfloat16 where it wins, ``tensor_parallel_size=N`` (``executor/``, ``parallel/``),
LoRA adapters (``enable_lora=True``, ``generate(..., lora_request=LoRARequest(name, id, path))``,
``lora/``), a pooling runner with ``embed`` and ``score`` for embedding models (``pooling/``), and
images in a prompt for a vision-language model (``multimodal/``): ``generate({"prompt": ...,
"multi_modal_data": {"image": image}})`` as vLLM takes them, and ``chat`` with image content parts
(``image_pil``, or an ``image_url`` holding a ``data:`` URL).

vLLM: ``vllm/entrypoints/llm.py`` over ``vllm/v1/engine/llm_engine.py``.
"""

from __future__ import annotations

from typing import Any

from shared.llm_base import BaseLLM, PromptType, prompt_token_ids
from shared.parallel_sampling import ParentRequest
from shared.request import Request
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from stage5_server.config import ENGINE_ARGS, SERVER_ENGINE_ARGS, EngineConfig
from stage5_server.core import EngineCore, build_engine_core
from stage5_server.lora import LoRARequest, load_adapter
from stage5_server.multimodal.image_io import decode_data_url, load_image
from stage5_server.multimodal.processor import ImageProcessor, has_image_parts, images_of, split_image_parts
from stage5_server.pooling.offline import PoolingAPI


class LLM(PoolingAPI, BaseLLM):
    stage = "stage5_server"
    engine_args = SERVER_ENGINE_ARGS

    def __init__(self, model: str | None = None, **kwargs: Any):
        config = EngineConfig.create(model, **kwargs)
        self.engine: EngineCore = build_engine_core(config)
        self.config = config = self.engine.config  # with max_model_len as the KV cache allows
        self.args = {**ENGINE_ARGS, **config.args}
        self.model_path, self.model_config = config.model_path, config.model_config
        self.device, self.dtype, self.max_model_len = config.device, config.dtype, config.max_model_len
        self.attention_backend_name = config.attention_backend
        self.tensor_parallel_size = config.parallel.tensor_parallel_size
        self.pipeline_parallel_size = config.parallel.pipeline_parallel_size
        self.kv_cache_capacity = self.engine.num_kv_blocks * config.cache.block_size
        self.tokenizer = Tokenizer(config.tokenizer_path)
        self.image_processor = None if config.model_config.vision is None else \
            ImageProcessor(config.model_path, config.model_config)
        self._checked_adapters: set[tuple[int, str]] = set()
        self._start_frontend()  # the builder has logged the configuration

    def check_lora_request(self, lora_request: object) -> None:
        """An adapter is served only with ``enable_lora``, and only once its directory passed the checks
        the workers will make (``lora/adapter.py``): a bad one fails here, before any request is queued."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: must be a stage5_server.lora.LoRARequest, got {lora_request!r}")
        lora = self.config.lora
        if lora is None:
            raise ValueError("lora_request: this engine serves no adapters; build it with enable_lora=True")
        if lora_request.key not in self._checked_adapters:
            load_adapter(lora_request.lora_path, self.model_config, lora.max_lora_rank)
            self._checked_adapters.add(lora_request.key)

    def _make_requests(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None, lora_request: object | None = None,
                       ) -> tuple[str, ParentRequest | None, list[Request]]:
        if not (isinstance(prompt, dict) and "multi_modal_data" in prompt):
            return super()._make_requests(prompt, params, request_id, priority, cache_salt, lora_request)
        if self.image_processor is None:
            raise ValueError("multi_modal_data: this model takes no images (it is not a vision-language model)")
        text = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        token_ids = prompt_token_ids(text, self.tokenizer, self.model_config.vocab_size, max_model_len=None)
        token_ids, features = self.image_processor.process(token_ids, images_of(prompt["multi_modal_data"]))
        request_id, parent, requests = super()._make_requests(token_ids, params, request_id, priority, cache_salt,
                                                              lora_request)
        for request in requests:
            request.mm_features = features
        return request_id, parent, requests

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             **template_args: Any):
        """``BaseLLM.chat``; a conversation with image parts is rendered with one image token per image
        and sent as ``{"prompt_token_ids": ..., "multi_modal_data": ...}``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not any(has_image_parts(c) for c in conversations):
            return super().chat(messages, sampling_params, use_tqdm, **template_args)
        prompts = []
        for conversation in conversations:
            rendered, images = split_image_parts(conversation, offline_image)
            token_ids = self.tokenizer.apply_chat_template(
                rendered, template_args.get("add_generation_prompt", True), tools=template_args.get("tools"),
                chat_template=template_args.get("chat_template"),
                chat_template_kwargs=template_args.get("chat_template_kwargs"))
            prompts.append({"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.engine.shutdown()


def offline_image(part: dict):
    """An image content part of an offline conversation: ``image_pil`` (a PIL image) or an
    ``image_url`` with a ``data:`` URL (fetching remote URLs is the API server's, under its rules)."""
    if part.get("type") == "image_pil":
        return part["image_pil"]
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError("messages: offline, an image part is an image_pil or an image_url with a data: URL")
    return load_image(decode_data_url(url))


__all__ = ["LLM", "SERVER_ENGINE_ARGS"]
