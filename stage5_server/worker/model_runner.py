"""The model runner: one step's forward pass over the persistent input batch, then sampling.

``execute_model(step)`` brings the ``InputBatch`` up to date with the step's ``ModelRunnerInput``,
gathers the inputs, maps each token row to its request's LoRA adapter slot (``lora/``), runs the
model, scores prompt positions for requests that asked for ``prompt_logprobs``, and computes logits
at every position that samples: a request's last position, plus one per draft token under
verification. The same code runs on every rank; only the driver (TP rank 0 of the last pipeline
stage) samples and answers, the other ranks' logits go unused, and a pipeline stage before the
last stops once it has sent its hidden states on.

Sampling gives each request a *list* of tokens. Without draft tokens that list has one token.
With drafts ``d_1 .. d_k`` (scheduled as ``k`` extra positions after the last known token) the
runner samples at each position in turn, each with the outputs so far extended by the drafts
before it, and keeps going while the token it samples equals the draft: the list is the accepted
drafts and then the first token that differs (or one past the last draft). Every token kept is a
draw from the target model's own distribution given the tokens before it, so the output is what
plain decoding gives (token for token under greedy); the rejected positions' KV is simply
overwritten later, since the scheduler rolls ``num_computed_tokens`` back past them.

With a draft model (``spec_decode/draft_model.py``), the runner then lets it propose the next
drafts of each sampling request the policy asks drafts of (the draft catches up on the positions
it has not run first); they go back to the core with the sampled tokens. A request that samples
gets drafts drawn from the draft's distribution ``q``; the runner keeps ``q`` until the drafts
come back for verification and checks them by the rejection rule instead, against the target's
distribution at each position (``spec_decode/rejection_sampler.py``).

vLLM: ``GPUModelRunner.execute_model`` and ``sample_tokens`` in ``vllm/v1/worker/gpu_model_runner.py``;
the accept-while-equal rule is ``vllm/v1/sample/rejection_sampler.py`` for a draft that gives no
probabilities (as n-gram drafts do), the rejection rule its case with ``draft_probs``.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.model import DecoderModel
from shared.model_runner import score_prompt_tokens
from shared.sampler import gather_logprobs, sample, target_probs
from shared.structured_output import unpack_bitmask
from stage5_server.lora import LoRAModelManager
from stage5_server.multimodal.encoder import MultiModalEmbedder
from stage5_server.spec_decode.draft_model import DraftModelProposer
from stage5_server.spec_decode.rejection_sampler import rejection_sample
from stage5_server.worker.input_batch import CachedRequestState, InputBatch, PreparedStep
from stage5_server.worker.runner_io import ModelRunnerInput, ModelRunnerOutput


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
        # A draft model's sampled drafts, until verified: request id -> (drafts, the distributions they came from)
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    def execute_model(self, step: ModelRunnerInput) -> ModelRunnerOutput | None:
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
            gone = [*step.finished_req_ids, *step.preempted_req_ids, *(r.req_id for r in step.new_reqs)]
            self.drafter.forget(gone)
            for request_id in gone:
                self.draft_probs.pop(request_id, None)
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
            self._propose_drafts(output, step.num_drafts_to_propose)
        for state, before in zip(prepared.states, scored_before):
            scored = len(state.prompt_logprobs)
            if scored > before:  # sent to the core, which keeps them; here only their count matters
                output.prompt_logprobs[state.request_id] = state.prompt_logprobs[before:]
                state.prompt_logprobs[before:] = [None] * (scored - before)
        return output

    def sample_tokens(self, step: ModelRunnerInput, prepared: PreparedStep, logits: torch.Tensor) -> ModelRunnerOutput:
        states = [prepared.states[i] for i in prepared.inputs.sample_rows]
        first_rows, offset = [], 0
        for num_draft in prepared.num_draft:
            first_rows.append(offset)
            offset += 1 + num_draft
        logits = apply_grammar_masks(logits, states, first_rows, prepared.num_draft, step)
        drafts = [step.spec_token_ids.get(state.request_id, []) for state in states]
        draft_probs = [self._draft_probs(state.request_id, d) for state, d in zip(states, drafts)]
        point = [i for i, q in enumerate(draft_probs) if q is None]  # no drafts, or drafts without probabilities
        sampled: list[list[int]] = [[] for _ in states]
        first = logits if offset == len(states) else logits[[first_rows[i] for i in point]]
        for i, token in zip(point, sample(first, [states[i] for i in point], self.generator)):
            sampled[i] = [token]
        if offset != len(states):
            self._verify_drafts(states, drafts, first_rows, logits, sampled)
            for i, q in enumerate(draft_probs):
                if q is not None:
                    sampled[i] = self._rejection_sample(states[i], drafts[i], q, logits[first_rows[i]:][:len(q) + 1])
        output = ModelRunnerOutput([state.request_id for state in states], sampled)
        for state in states:
            if state.logprobs:
                output.logprobs[state.request_id], state.logprobs = state.logprobs, []
        return output

    def _draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The distributions a draft model drew ``drafts`` from (the scheduler may have cut them), or None."""
        proposed = self.draft_probs.pop(request_id, None) if drafts else None
        if proposed is None or proposed[0][:len(drafts)] != drafts:
            return None
        return proposed[1][:len(drafts)]

    def _rejection_sample(self, state: CachedRequestState, drafts: list[int], draft_probs: torch.Tensor,
                          logits: torch.Tensor) -> list[int]:
        """Sampled drafts: the rejection rule against the target's distribution at each position (each
        computed with the drafts before it as outputs, for the penalties), plus logprobs if asked."""
        before = len(state.output_token_ids)
        targets = []
        for j in range(len(drafts) + 1):
            targets.append(target_probs(logits[j:j + 1], [state])[0])
            if j < len(drafts):
                state.output_token_ids.append(drafts[j])
        del state.output_token_ids[before:]
        tokens = rejection_sample(torch.stack(targets), drafts, draft_probs, state.generator or self.generator)
        if state.sampling_params.logprobs is not None:
            raw = logits[:len(tokens)].to("cpu", torch.float32).log_softmax(dim=-1)
            num_top = [state.sampling_params.logprobs] * len(tokens)
            state.logprobs.extend(gather_logprobs(raw, torch.tensor(tokens), num_top))
        return tokens

    def _verify_drafts(self, states: list[CachedRequestState], drafts: list[list[int]], first_rows: list[int],
                       logits: torch.Tensor, sampled: list[list[int]]) -> None:
        """Extend each request's list while its sampled token equals the next draft (module docstring);
        a request whose list is still empty verifies by the rejection rule instead."""
        num_outputs = [state.num_output_tokens for state in states]
        for position in range(1, max(map(len, drafts)) + 1):
            # Still verifying: every draft before this one was accepted (its list has one token per position so
            # far), and the token sampled at the last position is the next draft.
            active = [i for i, tokens in enumerate(sampled) if len(drafts[i]) >= position
                      and len(tokens) == position and tokens[-1] == drafts[i][position - 1]]
            if not active:
                break
            for i in active:  # the sampler sees the drafts accepted so far as outputs
                states[i].output_token_ids.append(drafts[i][position - 1])
            tokens = sample(logits[[first_rows[i] + position for i in active]], [states[i] for i in active],
                            self.generator)
            for i, token in zip(active, tokens):
                sampled[i].append(token)
        for state, before in zip(states, num_outputs):  # the core sends the real outputs next step
            del state.output_token_ids[before:]

    def _propose_drafts(self, output: ModelRunnerOutput, num_drafts: dict[str, int] | None) -> None:
        """The draft model's next drafts for each request that sampled, wants some and has room for them."""
        batch, k = self.input_batch, self.drafter.k
        ids, rows, tokens, wanted = [], [], [], []
        for request_id, sampled in zip(output.req_ids, output.sampled_token_ids):
            state, row = batch.states[request_id], batch.row_of[request_id]
            position = state.num_tokens + len(sampled) - 1  # where the last token sampled goes
            want = k if num_drafts is None else min(k, num_drafts.get(request_id, k))
            if want > 0 and position + k <= batch.max_model_len:
                ids.append(request_id)
                wanted.append(want)
                rows.append(row)
                tokens.append(np.concatenate([batch.token_ids[row, :state.num_tokens], sampled]))
        if ids:
            states = [batch.states[request_id] for request_id in ids]
            drafts, probs = self.drafter.propose(batch.block_table, batch.num_blocks, rows, states, tokens,
                                                 max(wanted), self.generator)
            output.draft_token_ids = {i: d[:n] for i, d, n in zip(ids, drafts, wanted)}
            for request_id, d, q, n in zip(ids, drafts, probs, wanted):
                if q is not None:
                    self.draft_probs[request_id] = (d[:n], q[:n])


def apply_grammar_masks(logits: torch.Tensor, states: list[CachedRequestState], first_rows: list[int],
                        num_draft: list[int], step: ModelRunnerInput) -> torch.Tensor:
    """-inf wherever a request's grammar forbids the token, at each of its positions that sample; the
    masks come computed from the core, one per such position, in ``grammar_req_ids`` order."""
    if step.grammar_bitmask is None:
        return logits
    index = {state.request_id: i for i, state in enumerate(states)}
    rows = [row for request_id in step.grammar_req_ids
            for row in range(first_rows[index[request_id]], first_rows[index[request_id]] + 1 +
                             num_draft[index[request_id]])]
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    allowed[rows] = unpack_bitmask(step.grammar_bitmask, logits.shape[-1])
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
