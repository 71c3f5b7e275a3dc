"""A persistent input batch: one row per running request, updated in place between steps.

stages 3 and 4 rebuild a step's inputs from Python lists every step (``shared/model_runner.py``
``prepare_inputs`` and stage 3's ``kv_layout``). Here each running request owns a row of two
preallocated arrays, its token ids and its block table, filled once when the request arrives (or
comes back after a preemption) and afterwards written only where it changed: the tokens it
sampled, a new block every ``block_size`` tokens (``update``, from the step's ``SchedulerOutput``).
Draft tokens under verification are written past the row's known tokens and overwritten by what
is accepted. Beside the rows, a ``CachedRequestState`` per request keeps what the sampler reads
(parameters, prompt and output tokens, a seeded request's generator); it outlives a preemption.

A step's inputs are then a handful of array operations over the scheduled rows, in the order
the core lists them (running requests first, as stage 3 packs them):

- ``positions``: each row's ``num_computed_tokens`` plus ``0 .. num_new - 1``;
- ``input_ids``: gathered from the token rows at those positions;
- ``slot_mapping``: ``block_table[row, position // block_size] * block_size + position % block_size``;
- ``block_tables``: the scheduled rows, cut to the widest of them (zero past each row's blocks);
- ``logits_indices``: the positions whose logits are sampled: a request's last position, and one
  before it per draft token.

vLLM: ``InputBatch`` and ``CachedRequestState`` in ``vllm/v1/worker/gpu_input_batch.py``,
``BlockTable`` in ``vllm/v1/worker/block_table.py`` and ``_update_states`` / ``_prepare_inputs`` in
``vllm/v1/worker/gpu_model_runner.py``. vLLM also keeps its rows dense (``condense``) and its
sampling parameters in per-row tensors; here free rows are reused as they come.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shared.model_runner import StepInputs
from shared.outputs import Logprob
from shared.request import Request
from shared.sampling_params import SamplingParams
from stage2_paged.attention import PagedAttentionMetadata
from stage5_server.outputs import NewRequestData, SchedulerOutput

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32}
INITIAL_TOKENS_PER_ROW = 2048  # (or max_model_len if shorter); rows widen, doubling, when a longer request arrives


def concatenated_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``range(starts[i], starts[i] + counts[i])`` for each ``i``, one after another, as one array."""
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends) else 0)


@dataclass
class CachedRequestState:
    """A request as the runner keeps it: what the sampler and the prompt scorer read (the names are
    ``shared.request.Request``'s, so ``shared/sampler.py`` takes either)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    bad_words_token_ids: list[list[int]]
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None
    lora_request: Any = None  # its adapter (lora/); None: the base model
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # filled by the sampler, sent back
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    mm_features: list = field(default_factory=list)  # the prompt's images (multimodal/)

    # The sampler's reads, as ``Request`` answers them.
    num_prompt_tokens = Request.num_prompt_tokens
    num_output_tokens = Request.num_output_tokens
    stop_token_ids_for_min_tokens = Request.stop_token_ids_for_min_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        seed = new.sampling_params.seed
        state = cls(new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), new.sampling_params,
                    tuple(new.eos_token_ids), [list(w) for w in new.bad_words_token_ids],
                    generator=None if seed is None else torch.Generator().manual_seed(seed),
                    mm_features=list(new.mm_features), lora_request=new.lora_request)
        state.prompt_logprobs = [None] * new.num_prompt_logprobs_done
        return state


@dataclass
class PreparedStep:
    """One step's inputs, gathered from the rows."""

    states: list[CachedRequestState]  # the scheduled requests, in packing order
    num_scheduled: list[int]
    inputs: StepInputs
    attn_metadata: PagedAttentionMetadata
    logits_indices: list[int]  # token rows whose logits are computed, grouped by request
    num_draft: list[int]  # per sampling request (``inputs.sample_rows``): its draft tokens


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 device: torch.device | str = "cpu"):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = torch.device(device)
        self.token_ids = np.zeros((0, 0), dtype=np.int32)  # [rows, tokens]
        self.block_table = np.zeros((0, 0), dtype=np.int32)  # [rows, blocks]
        self.num_blocks = np.zeros(0, dtype=np.int64)  # per row: block ids written
        self.num_tokens = np.zeros(0, dtype=np.int64)  # per row: known tokens written (drafts not counted)
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []
        self.states: dict[str, CachedRequestState] = {}  # every request the workers hold, running or preempted
        self._resize(max_num_reqs, min(max_model_len, INITIAL_TOKENS_PER_ROW))

    @property
    def num_rows(self) -> int:
        return len(self.num_blocks)

    # ---- rows in and out -------------------------------------------------------------------
    def add_request(self, state: CachedRequestState, block_ids: list[int]) -> int:
        """Give a request a row holding all its tokens and blocks (replacing any row it had)."""
        self.remove_row(state.request_id)
        if not self.free_rows:
            self._resize(2 * self.num_rows, self.token_ids.shape[1])
        row = self.free_rows.pop()
        self._fit(state.num_tokens, len(block_ids))
        self.token_ids[row, :state.num_prompt_tokens] = state.prompt_token_ids
        self.token_ids[row, state.num_prompt_tokens:state.num_tokens] = state.output_token_ids
        self.block_table[row, :self.num_blocks[row]] = 0
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self.num_tokens[row] = state.num_tokens
        self.row_of[state.request_id] = row
        return row

    def remove_row(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def remove_request(self, request_id: str) -> None:
        self.remove_row(request_id)
        self.states.pop(request_id, None)

    def _fit(self, num_tokens: int, num_blocks: int) -> None:
        """Widen every row (doubling) so that one holds ``num_tokens`` tokens and ``num_blocks`` blocks."""
        needed = max(num_tokens, num_blocks * self.block_size)
        width = self.token_ids.shape[1]
        if needed <= width and num_blocks <= self.block_table.shape[1]:
            return
        while width < needed:
            width *= 2
        self._resize(self.num_rows, width)

    def _resize(self, num_rows: int, tokens_per_row: int) -> None:
        old_rows, old_tokens = self.token_ids.shape
        blocks_per_row = -(-tokens_per_row // self.block_size)
        token_ids = np.zeros((num_rows, tokens_per_row), dtype=np.int32)
        block_table = np.zeros((num_rows, blocks_per_row), dtype=np.int32)
        token_ids[:old_rows, :old_tokens] = self.token_ids
        block_table[:old_rows, :self.block_table.shape[1]] = self.block_table
        self.token_ids, self.block_table = token_ids, block_table
        if num_rows != old_rows:  # (only then: ``update`` holds these arrays while rows widen)
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(num_rows - old_rows, dtype=np.int64)])
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros(num_rows - old_rows, dtype=np.int64)])
        self.free_rows = list(range(num_rows - 1, old_rows - 1, -1)) + self.free_rows

    # ---- one step --------------------------------------------------------------------------
    def update(self, step: SchedulerOutput) -> tuple[list[CachedRequestState], list[int]]:
        """Bring the states and rows up to date with ``step``: forget finished requests, free the rows
        of preempted ones, write what running ones gained, (re)fill new ones. Returns the scheduled
        requests' states and rows, in the step's order (running ones, then new ones)."""
        for request_id in step.finished_req_ids:
            self.remove_request(request_id)
        for request_id in step.preempted_req_ids:
            self.remove_row(request_id)
        grown_rows, num_grown, token_values = [], [], []  # rows that gained tokens: how many, which
        block_rows, block_cols, block_values = [], [], []
        states, row_of, num_blocks = self.states, self.row_of, self.num_blocks
        cached = step.scheduled_cached_reqs
        scheduled_states, scheduled_rows = [], []
        for request_id, new_tokens, new_blocks, num_computed in zip(
                cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens):
            state, row = states[request_id], row_of[request_id]
            scheduled_states.append(state)
            scheduled_rows.append(row)
            if new_tokens:  # a decode's one sampled token, or accepted drafts and the token after them
                state.output_token_ids += new_tokens
                grown_rows.append(row)
                num_grown.append(len(new_tokens))
                token_values += new_tokens
            if new_blocks:
                written = int(num_blocks[row])
                if written + len(new_blocks) > self.block_table.shape[1]:
                    self._fit(0, written + len(new_blocks))
                block_rows += [row] * len(new_blocks)
                block_cols.extend(range(written, written + len(new_blocks)))
                block_values.extend(new_blocks)
                num_blocks[row] = written + len(new_blocks)
            state.num_computed_tokens = num_computed
        if token_values:  # written after each row's known tokens
            rows, counts = np.array(grown_rows), np.array(num_grown)
            have = self.num_tokens[rows]
            self._fit(int((have + counts).max()), 0)
            self.token_ids[np.repeat(rows, counts), concatenated_ranges(have, counts)] = token_values
            self.num_tokens[rows] = have + counts
        if block_values:
            self.block_table[block_rows, block_cols] = block_values
        for new in step.scheduled_new_reqs:
            state = self.states.get(new.req_id)
            if state is None:  # first seen; a resumed request keeps its state (and its generator's draws)
                state = self.states[new.req_id] = CachedRequestState.from_new(new)
            else:
                state.output_token_ids = list(new.output_token_ids)
            state.num_computed_tokens = new.num_computed_tokens
            scheduled_states.append(state)
            scheduled_rows.append(self.add_request(state, new.block_ids))
        for request_id, drafts in step.scheduled_spec_decode_tokens.items():  # past the known tokens, until verified
            state, row = self.states[request_id], self.row_of[request_id]
            self._fit(state.num_tokens + len(drafts), 0)
            self.token_ids[row, state.num_tokens:state.num_tokens + len(drafts)] = drafts
        return scheduled_states, scheduled_rows

    def prepare(self, step: SchedulerOutput) -> PreparedStep:
        """``update``, then gather the step's inputs from the scheduled rows."""
        states, rows = self.update(step)
        assert len(states) == len(step.num_scheduled_tokens), "a scheduled request the workers do not hold"
        rows_a = np.array(rows, dtype=np.int64)
        num_scheduled = [step.num_scheduled_tokens[state.request_id] for state in states]
        counts = np.array(num_scheduled, dtype=np.int64)
        starts = np.array(step.scheduled_cached_reqs.num_computed_tokens +
                          [new.num_computed_tokens for new in step.scheduled_new_reqs],
                          dtype=np.int64)  # as ``update`` set them
        ends = np.cumsum(counts)
        drafts_of = step.scheduled_spec_decode_tokens
        drafts = np.array([len(drafts_of.get(state.request_id, ())) for state in states] if drafts_of
                          else np.zeros(len(states)), dtype=np.int64)
        # A request samples when this step reaches its last known token (not mid-way through a
        # prefill); with draft tokens, at the position before each of them too.
        samples = np.flatnonzero(starts + counts == self.num_tokens[rows_a] + drafts)
        num_draft = drafts[samples]
        first_logit = ends[samples] - 1 - num_draft  # per sampling request: its first sampled row
        logits_indices = concatenated_ranges(first_logit, num_draft + 1)
        inputs, meta = self._gather(rows_a, counts, starts, ends, samples.tolist(),
                                    int(self.num_blocks[rows_a].max()))
        return PreparedStep(states, num_scheduled, inputs, meta, logits_indices.tolist(),
                            num_draft.tolist())

    def _gather(self, rows_a: np.ndarray, counts: np.ndarray, first: np.ndarray, ends: np.ndarray,
                sample_rows: list[int], width: int) -> tuple[StepInputs, PagedAttentionMetadata]:
        if int(ends[-1]) == len(rows_a):  # decodes only: one token per row, at its next position
            token_rows, positions = rows_a, first
        else:
            token_rows, positions = np.repeat(rows_a, counts), concatenated_ranges(first, counts)
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        block_size = self.block_size
        slots = self.block_table[token_rows, positions // block_size].astype(np.int64) * block_size
        slots += positions % block_size
        seq_lens = first + counts
        query_start_loc = np.concatenate([np.zeros(1, dtype=np.int64), ends])
        tables = self.block_table[rows_a, :width]
        device = self.device

        def as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.from_numpy(array.astype(_NUMPY_DTYPES[dtype], copy=False))
            return tensor if device.type == "cpu" else tensor.to(device)

        inputs = StepInputs(as_tensor(input_ids, torch.long), as_tensor(positions, torch.long),
                            query_start_loc.tolist(), seq_lens.tolist(), sample_rows)
        meta = PagedAttentionMetadata(
            slot_mapping=as_tensor(slots, torch.long), query_start_loc=as_tensor(query_start_loc, torch.int32),
            seq_lens=as_tensor(seq_lens, torch.int32), block_tables=as_tensor(tables, torch.int32),
            max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()))
        return inputs, meta
