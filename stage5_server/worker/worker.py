"""One worker per rank: its device, its model (whole, or its tensor-parallel shard), its KV cache,
the attention backend over that cache, and the model runner; with a vision-language model, its
vision tower and projector; with a draft model
(``speculative_config``'s ``draft_model``), that model and its own KV cache too. The same class on one device and on
every rank of a split model; the executor decides only where each worker lives.

Its life, as the executor drives it: built (loads the weights) -> ``kv_bytes_per_token`` and, on a
GPU, ``determine_available_memory`` (the builder sizes the pool from them) -> ``initialize_kv_cache``
(allocates the blocks, installs the backend, builds the runner) -> ``execute_model`` once per step.
Under pipeline parallelism a worker holds its stage's layers (``parallel/pipeline.py``), and its KV
cache has room for those layers only.

vLLM: ``vllm/v1/worker/gpu_worker.py`` (``Worker``: ``load_model``, ``determine_available_memory``,
``initialize_from_config``, ``execute_model``).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from shared.llm_base import kv_bytes_per_token
from shared.named_models import resolve_model
from shared.weights import load_model
from stage2_paged.kv_cache import PagedKVCache
from stage5_server.attention import ATTENTION_BACKENDS
from stage5_server.attention.memory import profile_free_kv_memory
from stage5_server.config import EngineConfig
from stage5_server.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from stage5_server.cpu_kernels import load_cpu_kernels
from stage5_server.lora import LoRAModelManager
from stage5_server.model import compile_decode_step, compile_problem, fuse_projections
from stage5_server.multimodal.encoder import MultiModalEmbedder
from stage5_server.multimodal.vision import decoder_tensor_name, load_vision_model
from stage5_server.parallel.parallel_state import RankPlace
from stage5_server.parallel.pipeline import PipelineStage, load_stage_model
from stage5_server.parallel.sharded_model import load_sharded_model
from stage5_server.quantization import install_linear_methods
from stage5_server.spec_decode.draft_model import DraftModelProposer
from stage5_server.worker.input_batch import InputBatch
from stage5_server.worker.model_runner import ModelRunner

logger = logging.getLogger("stagedserve")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, device: torch.device | None = None):
        self.config = config
        self.rank = rank
        parallel = config.parallel
        self.place = place = RankPlace(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        world_size = parallel.world_size
        if device is None:  # on one host, rank r has GPU r (a Ray actor is given the one Ray assigned it)
            device = torch.device("cuda", rank) if world_size > 1 and config.device.type == "cuda" else config.device
        self.device = device
        if parallel.pipeline_parallel_size > 1:
            model = load_stage_model(config.model_path, place, config.dtype, self.device)
        elif world_size > 1:
            model, _ = load_sharded_model(config.model_path, rank, world_size, config.dtype, self.device)
        elif config.multimodal is not None:  # a vision-language checkpoint: its decoder, under language_model.
            model, _ = load_model(config.model_path, config.dtype, self.device, config.model_config,
                                  decoder_tensor_name)
        else:
            model, _ = load_model(config.model_path, config.dtype, self.device)
        self.model = fuse_projections(model)  # q/k/v (gate/up) fused into one GEMM each
        if world_size == 1:  # packed or quantized linears (quantization/config.py); plain when split
            logger.info(install_linear_methods(self.model, config.linear))
        # LoRA slots over every projection's own method, each rank holding its part (lora/manager.py)
        self.lora_manager = None if config.lora is None else LoRAModelManager(
            self.model, config.model_config, config.lora, tp_rank=place.tp_rank, tp_size=parallel.tensor_parallel_size)
        if parallel.pipeline_parallel_size > 1:  # receives its input from the stage before, or sends it on
            self.model = PipelineStage(self.model, place, config.dtype, self.device)
        spec = config.speculative
        self.draft_model = None
        if spec is not None and spec.method == "draft_model":  # one rank: EngineConfig refuses a split one
            self.draft_model = fuse_projections(load_model(resolve_model(spec.model), config.dtype, self.device)[0])
        self.vision = None  # a vision-language model's tower and projector (multimodal/vision.py)
        if config.multimodal is not None:  # one rank: EngineConfig refuses a split one
            self.vision = load_vision_model(config.model_path, config.model_config, config.multimodal, config.dtype,
                                            self.device)
        self.kv_cache: PagedKVCache | None = None
        self.model_runner: ModelRunner | None = None
        self.timeline: list[tuple[float, float]] | None = None  # when set to []: (start, end) of each stretch of work

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
        backend = ATTENTION_BACKENDS[config.attention_backend](self.kv_cache)
        self.model.set_attention_backend(backend)
        if config.compile_decode:  # decode batches of a few rows: a compiled graph (model/compile.py)
            problem = load_cpu_kernels() or compile_problem(self.model) or \
                compile_decode_step(self.model, [*self.kv_cache.key, *self.kv_cache.value])
            if problem is not None:  # a warning where enforce_eager=False asked for it
                logger.log(logging.WARNING if config.enforce_eager is False else logging.INFO,
                           "decode steps run eagerly: %s", problem)
        input_batch = InputBatch(config.scheduler.max_num_seqs, max_model_len, block_size, self.device)
        drafter = None
        if self.draft_model is not None:
            drafter = DraftModelProposer(self.draft_model, config.speculative.num_speculative_tokens, num_blocks,
                                         block_size, config.scheduler.max_num_seqs, config.dtype, self.device,
                                         ATTENTION_BACKENDS[config.attention_backend])
        mm_embedder = None if self.vision is None else MultiModalEmbedder(self.vision, self.device, config.dtype)
        self.model_runner = ModelRunner(self.model, input_batch, config.seed, is_driver=self.place.is_driver,
                                        drafter=drafter, mm_embedder=mm_embedder, lora_manager=self.lora_manager)

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
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
