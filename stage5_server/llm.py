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
``lora/``), and a pooling runner with ``embed`` and ``score`` for embedding models (``pooling/``).

vLLM: ``vllm/entrypoints/llm.py`` over ``vllm/v1/engine/llm_engine.py``.
"""

from __future__ import annotations

from typing import Any

from shared.llm_base import BaseLLM
from shared.tokenizer import Tokenizer
from stage5_server.config import ENGINE_ARGS, SERVER_ENGINE_ARGS, EngineConfig
from stage5_server.core import EngineCore, build_engine_core
from stage5_server.lora import LoRARequest, load_adapter
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
        self.kv_cache_capacity = self.engine.num_kv_blocks * config.cache.block_size
        self.tokenizer = Tokenizer(config.tokenizer_path)
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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.engine.shutdown()


__all__ = ["LLM", "SERVER_ENGINE_ARGS"]
