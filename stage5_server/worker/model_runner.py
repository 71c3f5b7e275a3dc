"""The model runner: one step's forward pass over the persistent input batch, then sampling.

``execute_model(step)`` brings the ``InputBatch`` up to date with the step's ``SchedulerOutput``,
gathers the inputs, maps each token row to its request's LoRA adapter slot (``lora/``), runs the
model (with a vision-language model's image features at their placeholders: ``multimodal/``), scores
prompt positions for requests that asked for ``prompt_logprobs``, and computes logits at every
position that samples: a request's last position, plus one per draft token under verification. The
same code runs on every rank; only the driver (TP rank 0 of the last pipeline stage) samples and
answers, the other ranks' logits go unused, and a pipeline stage before the last stops once it has
sent its hidden states on.

Sampling gives each request a *list* of tokens: one, or with draft tokens the accepted drafts and one
more (``spec_decode/verify.py``, called once per step that verifies drafts). With a draft model on the
worker (``spec_decode/draft_model.py``), the runner then lets it propose each request's next drafts;
they go back to the core with the sampled tokens.

vLLM: ``GPUModelRunner.execute_model`` and ``sample_tokens`` in ``vllm/v1/worker/gpu_model_runner.py``.
"""

from __future__ import annotations

import torch

from shared.model import DecoderModel
from shared.model_runner import score_prompt_tokens
from shared.sampler import sample
from shared.structured_output import unpack_bitmask
from stage5_server.lora import LoRAModelManager
from stage5_server.multimodal.encoder import MultiModalEmbedder
from stage5_server.outputs import ModelRunnerOutput, SchedulerOutput
from stage5_server.spec_decode.draft_model import DraftModelProposer
from stage5_server.spec_decode.verify import verify
from stage5_server.worker.input_batch import CachedRequestState, InputBatch, PreparedStep


class ModelRunner:
    def __init__(self, model: DecoderModel, input_batch: InputBatch, seed: int = 0, is_driver: bool = True,
                 drafter: DraftModelProposer | None = None, mm_embedder: MultiModalEmbedder | None = None,
                 lora_manager: LoRAModelManager | None = None):
        self.model = model
        self.mm_embedder = mm_embedder  # a vision-language model's image features (multimodal/encoder.py)
        self.lora_manager = lora_manager  # adapter slots and the step's token-to-slot map (lora/)
        self.drafter = drafter  # a draft model, run after the target (spec_decode/draft_model.py)
        self.input_batch = input_batch
        self.is_driver = is_driver
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded sampled requests

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        prepared = self.input_batch.prepare(step)
        inputs = prepared.inputs
        if self.lora_manager is not None:
            self.lora_manager.set_active_loras([state.lora_request for state in prepared.states],
                                               prepared.num_scheduled)
        embeds = None
        if self.mm_embedder is not None:
            self.mm_embedder.forget([*step.finished_req_ids, *step.preempted_req_ids])
            embeds = self.mm_embedder.inputs_embeds(self.model.embed_tokens, inputs.input_ids, prepared.states,
                                                    prepared.num_scheduled)
        if embeds is None:
            hidden = self.model(inputs.input_ids, inputs.positions, prepared.attn_metadata)
        else:  # image features at their placeholders
            hidden = self.model(inputs.input_ids, inputs.positions, prepared.attn_metadata, inputs_embeds=embeds)
        if hidden is None:  # a pipeline stage before the last: it sent its output on (parallel/pipeline.py)
            return None
        if self.drafter is not None:  # rows gone or new: the draft's cache holds nothing of them yet
            self.drafter.forget([*step.finished_req_ids, *step.preempted_req_ids,
                                 *(new.req_id for new in step.scheduled_new_reqs)])
        scored_before = [len(state.prompt_logprobs) for state in prepared.states]
        score_prompt_tokens(self.model, list(zip(prepared.states, prepared.num_scheduled)), inputs, hidden)
        logits = None
        if prepared.logits_indices:  # every rank computes them (the vocabulary is split across ranks)
            rows = torch.tensor(prepared.logits_indices, device=hidden.device)
            logits = self.model.compute_logits(hidden[rows])
        if not self.is_driver:
            return None
        output = self.sample_tokens(step, prepared, logits) if logits is not None else ModelRunnerOutput([], [])
        if self.drafter is not None and output.req_ids:
            output.draft_token_ids = self.drafter.propose_after_step(
                self.input_batch, output.req_ids, output.sampled_token_ids, step.num_drafts_to_propose, self.generator)
        for state, before in zip(prepared.states, scored_before):
            scored = len(state.prompt_logprobs)
            if scored > before:  # sent to the core, which keeps them; here only their count matters
                output.prompt_logprobs[state.request_id] = state.prompt_logprobs[before:]
                state.prompt_logprobs[before:] = [None] * (scored - before)
        return output

    def sample_tokens(self, step: SchedulerOutput, prepared: PreparedStep, logits: torch.Tensor) -> ModelRunnerOutput:
        states = [prepared.states[i] for i in prepared.inputs.sample_rows]
        first_rows, offset = [], 0
        for num_draft in prepared.num_draft:
            first_rows.append(offset)
            offset += 1 + num_draft
        logits = apply_grammar_masks(logits, states, first_rows, prepared.num_draft, step)
        if offset == len(states):  # no drafts: one token each
            sampled = [[token] for token in sample(logits, states, self.generator)]
        else:
            drafts = [step.scheduled_spec_decode_tokens.get(state.request_id, []) for state in states]
            draft_probs = [None if self.drafter is None else self.drafter.take_probs(state.request_id, d)
                           for state, d in zip(states, drafts)]
            sampled = verify(logits, states, drafts, first_rows, draft_probs, self.generator)
        output = ModelRunnerOutput([state.request_id for state in states], sampled)
        for state in states:
            if state.logprobs:
                output.logprobs[state.request_id], state.logprobs = state.logprobs, []
        return output


def apply_grammar_masks(logits: torch.Tensor, states: list[CachedRequestState], first_rows: list[int],
                        num_draft: list[int], step: SchedulerOutput) -> torch.Tensor:
    """-inf wherever a request's grammar forbids the token, at each of its positions that sample; the
    masks come computed from the core, one per such position, in ``structured_output_request_ids`` order."""
    if step.grammar_bitmask is None:
        return logits
    index = {state.request_id: i for i, state in enumerate(states)}
    rows = [row for request_id in step.structured_output_request_ids
            for row in range(first_rows[index[request_id]], first_rows[index[request_id]] + 1 +
                             num_draft[index[request_id]])]
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    allowed[rows] = unpack_bitmask(step.grammar_bitmask, logits.shape[-1])
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
