"""The workers of a pooling model: an encoder's (no KV cache at all) and a decoder's (the generating
worker's model and paged KV cache, with the pooling runner in place of the sampling one).

vLLM: ``vllm/v1/worker/gpu_worker.py`` (one worker class; the runner checks ``is_pooling_model``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from stage5_server.config.model import is_encoder
from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput
from stage5_server.pooling.bert import load_bert
from stage5_server.pooling.pooler import Pooler
from stage5_server.pooling.runner import DecoderPoolingRunner, EncoderModelRunner
from stage5_server.worker import InputBatch, Worker

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig


class EncoderWorker:
    """Loads the encoder; asks the scheduler's blocks for no memory: ``kv_bytes_per_token`` is 0."""

    def __init__(self, config: EngineConfig, rank: int = 0, device: torch.device | None = None):
        self.config, self.rank, self.device = config, rank, device or config.device
        self.model, _ = load_bert(config.model_path, config.dtype, self.device)
        self.model_runner: EncoderModelRunner | None = None

    def describe(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.device),
                "num_heads": self.model.config.num_attention_heads, "num_kv_heads": 0}

    def kv_bytes_per_token(self) -> int:
        return 0

    def determine_available_memory(self, num_tokens: int) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.model_runner = EncoderModelRunner(self.model, Pooler(self.config.pooler), self.device)

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(step)

    def shutdown(self) -> None:
        pass  # nothing held beyond the process


class DecoderPoolingWorker(Worker):
    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().initialize_kv_cache(num_blocks, block_size, max_model_len)
        batch = InputBatch(self.config.scheduler.max_num_seqs, max_model_len, block_size, self.device)
        self.model_runner = DecoderPoolingRunner(self.model, batch, Pooler(self.config.pooler))


def make_pooling_worker(config: EngineConfig, rank: int = 0, device: torch.device | None = None,
                        ) -> DecoderPoolingWorker | EncoderWorker:
    """The pooling runner kind's worker (``EngineConfig.worker_cls``): an encoder's, or a decoder's."""
    kind = EncoderWorker if is_encoder(config.model_config) else DecoderPoolingWorker
    return kind(config, rank, device)


__all__ = ["DecoderPoolingWorker", "EncoderWorker", "make_pooling_worker"]
