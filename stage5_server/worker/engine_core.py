"""stage 4's engine core with its step's inputs gathered from a persistent input batch.

Scheduling, sampling and the update after a step are stage 4's; ``execute_model`` changes:
instead of stage 3's ``scheduled_batch``, ``prepare_inputs``, ``kv_layout`` and
``build_paged_metadata`` (Python lists rebuilt from every request each step), the rows of an
``InputBatch`` are brought up to date and the step's tensors gathered from them. The tensors
are the same, so the model and the attention backend cannot tell the difference. A request
that finishes or is aborted gives its row back at once.

vLLM: ``GPUModelRunner.execute_model`` in ``vllm/v1/worker/gpu_model_runner.py`` (its
``_update_states`` then ``_prepare_inputs`` over the ``InputBatch``).
"""

from __future__ import annotations

import torch

from shared.model import DecoderModel
from shared.request import Request, RequestStatus
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

    # A request that finishes gives its row back at once: the next step, which would report it,
    # may never come, and the row must not keep the request alive.
    def step(self) -> list[Request]:
        updated = super().step()
        for request in updated:
            if request.is_finished:
                self.input_batch.remove_request(request.request_id)
        return updated

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        super().finish_requests(request_ids, status)
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.input_batch.remove_request(request_id)
