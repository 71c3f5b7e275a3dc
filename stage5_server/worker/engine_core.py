"""stage 4's engine core with its step's inputs gathered from a persistent input batch.

Scheduling, sampling and the update after a step are stage 4's; only ``execute_model`` changes:
instead of stage 3's ``scheduled_batch``, ``prepare_inputs``, ``kv_layout`` and
``build_paged_metadata`` (Python lists rebuilt from every request each step), the rows of an
``InputBatch`` are brought up to date and the step's tensors gathered from them. The tensors
are the same, so the model and the attention backend cannot tell the difference.

vLLM: ``GPUModelRunner.execute_model`` in ``vllm/v1/worker/gpu_model_runner.py`` (its
``_update_states`` then ``_prepare_inputs`` over the ``InputBatch``).
"""

from __future__ import annotations

import torch

from shared.model import DecoderModel
from stage2_paged.kv_cache import PagedKVCache
from stage3_continuous.engine import EngineCore, StatsLogger
from stage3_continuous.scheduler import Scheduler, SchedulerOutput
from stage5_server.worker.input_batch import InputBatch


class PersistentBatchEngineCore(EngineCore):
    def __init__(self, model: DecoderModel, scheduler: Scheduler, kv_cache: PagedKVCache, device: torch.device,
                 seed: int = 0, stats_logger: StatsLogger | None = None):
        super().__init__(model, scheduler, kv_cache, device, seed, stats_logger=stats_logger)
        self.input_batch = InputBatch(scheduler.config.max_num_seqs, self.max_model_len, kv_cache.block_size,
                                      device)

    def execute_model(self, output: SchedulerOutput) -> dict[str, int]:
        batch, inputs, meta = self.input_batch.prepare(output)
        return self.runner.execute(batch, inputs, meta)
