"""The pooling model runners: one step's forward, then a pooled vector for each request whose prompt the
step completes; no logits, no sampling.

- ``EncoderModelRunner`` (BERT): each scheduled request arrives whole (an encoder's attention is
  bidirectional, so a prompt cannot be split across steps), the step's prompts are right-padded into one
  batch and run without any KV cache.
- ``DecoderPoolingRunner`` (a decoder with ``convert="embed"``): the generating runner's persistent input
  batch and paged attention, chunked prefill included; the pooler adds each chunk's hidden rows.

vLLM: ``GPUModelRunner._pool`` in ``vllm/v1/worker/gpu_model_runner.py``; encoder-only attention in
``vllm/attention/layers/encoder_only_attention.py``.
"""

from __future__ import annotations

import torch

from shared.model import DecoderModel
from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput
from stage5_server.pooling.bert import BertModel
from stage5_server.pooling.pooler import Pooler
from stage5_server.worker.input_batch import InputBatch


class EncoderModelRunner:
    def __init__(self, model: BertModel, pooler: Pooler, device: torch.device):
        self.model, self.pooler, self.device = model, pooler, device

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if step.scheduled_cached_reqs.req_ids:
            raise RuntimeError("an encoder request was scheduled over two steps; its prompt must run whole")
        prompts = {new.req_id: new.prompt_token_ids for new in step.scheduled_new_reqs}
        for new in step.scheduled_new_reqs:
            if new.num_computed_tokens != 0 or step.num_scheduled_tokens[new.req_id] != len(new.prompt_token_ids):
                raise RuntimeError(f"request {new.req_id}: an encoder runs a whole prompt in one step")
        ids = step.scheduled_req_ids
        lengths = torch.tensor([len(prompts[i]) for i in ids])
        input_ids = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
        for row, request_id in enumerate(ids):
            input_ids[row, :lengths[row]] = torch.tensor(prompts[request_id])
        hidden = self.model(input_ids.to(self.device), lengths.to(self.device))
        pooled = self.pooler.pool_padded(hidden, lengths.to(self.device)).cpu()
        return ModelRunnerOutput([], [], pooler_output=dict(zip(ids, pooled)))


class DecoderPoolingRunner:
    def __init__(self, model: DecoderModel, input_batch: InputBatch, pooler: Pooler):
        self.model, self.input_batch, self.pooler = model, input_batch, pooler

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in step.finished_req_ids:
            self.pooler.forget(request_id)  # aborted mid-prompt
        prepared = self.input_batch.prepare(step)
        inputs = prepared.inputs
        hidden = self.model(inputs.input_ids, inputs.positions, prepared.attn_metadata)
        pooled, end = {}, 0
        for state, count in zip(prepared.states, prepared.num_scheduled):
            start, end = end, end + count
            self.pooler.add_rows(state.request_id, hidden[start:end], state.num_computed_tokens)
            if state.num_computed_tokens + count >= len(state.prompt_token_ids):
                pooled[state.request_id] = self.pooler.take(state.request_id).cpu()
        return ModelRunnerOutput([], [], pooler_output=pooled)
