"""One worker per rank: its device, its model (whole, or its tensor-parallel shard or pipeline stage:
``model_loader.py``), its KV cache, the attention backend over that cache, and the model runner; and what
each system adds on the rank, where it is on: LoRA slots (``lora/``), a draft model and its own KV cache
(``spec_decode/draft_model.py``), a vision tower and projector (``multimodal/``), the worker side of a KV
connector, called before and after each forward (``kv_transfer/``). The same class on one
device and on every rank of a split model; the executor decides only where each worker lives.

Its life, as the executor drives it: built (loads the weights) -> ``kv_bytes_per_token`` and, on a
GPU, ``determine_available_memory`` (the builder sizes the pool from them) -> ``initialize_kv_cache``
(allocates the blocks, installs the backend, builds the runner) -> ``execute_model`` once per step; between
steps, the adapters the server hands over (``add_lora`` / ``remove_lora``, through ``collective_rpc``), and
what a worker extension beside it adds (``extension``: weight updates and sleep, ``weight_sync/worker.py``).
Under pipeline parallelism a worker holds its stage's layers (``parallel/pipeline.py``), and its KV
cache has room for those layers only.

vLLM: ``vllm/v1/worker/gpu_worker.py`` (``Worker``: ``load_model``, ``determine_available_memory``,
``initialize_from_config``, ``execute_model``, ``add_lora``, ``remove_lora``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from shared.llm_base import kv_bytes_per_token
from stage2_paged.kv_cache import PagedKVCache
from stage5_server.attention import ATTENTION_BACKENDS
from stage5_server.attention.memory import profile_free_kv_memory
from stage5_server.cpu_kernels import load_cpu_kernels
from stage5_server.kv_transfer import KVConnectorRole, make_kv_connector
from stage5_server.lora import LoRAModel, LoRAModelManager, LoRARequest
from stage5_server.model import compile_step
from stage5_server.multimodal.encoder import MultiModalEmbedder
from stage5_server.multimodal.vision import load_vision_tower
from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput
from stage5_server.parallel.parallel_state import RankPlace
from stage5_server.parallel.pipeline import PipelineStage
from stage5_server.spec_decode.draft_model import DraftModelProposer, load_draft_model
from stage5_server.worker.input_batch import InputBatch
from stage5_server.worker.model_loader import load_rank_model
from stage5_server.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig

logger = logging.getLogger("stagedserve")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, device: torch.device | None = None):
        self.config = config
        self.rank = rank
        parallel = config.parallel
        self.place = place = RankPlace(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        if device is None:  # on one host, rank r has GPU r (a Ray actor is given the one Ray assigned it)
            device = torch.device("cuda", rank) if parallel.world_size > 1 and config.device.type == "cuda" \
                else config.device
        self.device = device
        self.model = load_rank_model(config, place, device)  # model_loader.py
        # What each system adds on this rank, None where it is off: LoRA slots over every projection's method,
        # each rank holding its part (lora/); a draft model (spec_decode/); a vision tower (multimodal/).
        self.lora_manager = LoRAModelManager.for_rank(self.model, config, place)
        self.draft_model = load_draft_model(config, device)
        self.vision = load_vision_tower(config, device)
        if parallel.pipeline_parallel_size > 1:  # receives its input from the stage before, or sends it on
            self.model = PipelineStage(self.model, place, config.dtype, device)
        self.kv_cache: PagedKVCache | None = None
        self.kv_connector = None  # the worker side of a KV connector (kv_transfer/), made with the KV cache
        self.model_runner: ModelRunner | None = None
        self.timeline: list[tuple[float, float]] | None = None  # when set to []: (start, end) of each stretch of work
        self.extension = None  # the config's worker extension over this worker, if any (executor/abstract.py)

    # ---- LoRA adapters: the server hands each one over whole once it has checked it (lora/manager.py) ----
    def add_lora(self, lora: LoRARequest, adapter: LoRAModel) -> bool:
        if self.lora_manager is None:
            raise ValueError("add_lora: this engine serves no adapters; start it with enable_lora=True")
        self.lora_manager.add_lora(lora, adapter)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)

    def describe(self) -> dict:
        config = self.model.config  # this rank's share: its heads
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device),
                "num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads,
                "num_layers": config.num_hidden_layers, "stage": self.place.pp_rank}

    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, on this rank (its own KV heads only), the draft model's
        included: its cache has a slot for every slot of the target's."""
        draft = 0 if self.draft_model is None else kv_bytes_per_token(self.draft_model.config, self.config.dtype)
        return kv_bytes_per_token(self.model.config, self.config.dtype) + draft

    def determine_available_memory(self, num_tokens: int) -> int:
        """Bytes of GPU memory the KV cache can have on this rank (``attention/memory.py``)."""
        return profile_free_kv_memory(self.model, self.device, num_tokens, self.config.cache.gpu_memory_utilization)

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        config, model_config = self.config, self.model.config
        self.kv_cache = PagedKVCache(num_blocks, block_size, model_config.num_hidden_layers,
                                     model_config.num_key_value_heads, model_config.head_dim, config.dtype,
                                     self.device)
        if config.kv_transfer is not None:
            if self.kv_connector is None:
                self.kv_connector = make_kv_connector(config.kv_transfer, KVConnectorRole.WORKER, block_size,
                                                      self.kv_bytes_per_token() * block_size,
                                                      config.parallel.world_size)
            self.kv_connector.register_kv_caches(self.kv_cache)
        backend = ATTENTION_BACKENDS[config.attention_backend](self.kv_cache)
        self.model.set_attention_backend(backend)
        if config.compile_step:  # every step a compiled graph (model/compile.py); with adapters, not their steps
            eager_if = None if self.lora_manager is None else self.lora_manager.step_has_adapters
            problem = load_cpu_kernels() or compile_step(self.model, [*self.kv_cache.key, *self.kv_cache.value],
                                                          config.scheduler.max_num_seqs, eager_if,
                                                          background=config.compile_in_background)
            if problem is not None:  # a warning where enforce_eager=False asked for it
                logger.log(logging.WARNING if config.enforce_eager is False else logging.INFO,
                           "every step runs eagerly: %s", problem)
        input_batch = InputBatch(config.scheduler.max_num_seqs, max_model_len, block_size, self.device)
        drafter = None if self.draft_model is None else DraftModelProposer(
            self.draft_model, config.speculative.num_speculative_tokens, num_blocks, block_size,
            config.scheduler.max_num_seqs, config.dtype, self.device, ATTENTION_BACKENDS[config.attention_backend])
        mm_embedder = None if self.vision is None else MultiModalEmbedder(self.vision, self.device, config.dtype)
        self.model_runner = ModelRunner(self.model, input_batch, config.seed, is_driver=self.place.is_driver,
                                        drafter=drafter, mm_embedder=mm_embedder, lora_manager=self.lora_manager)

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        transfer = step.kv_connector_metadata
        if transfer is None:
            return self._execute_model(step)
        self.kv_connector.start_load_kv(transfer)  # blocks the scheduler matched, before anything reads them
        output = self._execute_model(step)
        self.kv_connector.wait_for_save(transfer)  # the blocks this step completed
        return output

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.timeline is None:
            return self.model_runner.execute_model(step)
        start = time.monotonic()
        try:
            return self.model_runner.execute_model(step)
        finally:  # a pipeline stage's waits for its neighbours are not work
            waits = self.model.waits if isinstance(self.model, PipelineStage) else []
            for begin, end in waits:
                if begin > start:
                    self.timeline.append((start, begin))
                start = end
            self.timeline.append((start, time.monotonic()))
