"""A persistent input batch: one row per running request, updated in place between steps.

Each request that runs owns a row of two preallocated arrays: its token ids (prompt, then each
sampled token as it arrives) and its block table. A row is filled once when the request is
scheduled for the first time (or again after a preemption); afterwards a step writes only what
changed: the token sampled last step and, every ``block_size`` tokens, a new block id. A
request that finishes or is preempted gives its row back for the next one.

A step's inputs are then a handful of array operations over the scheduled rows, in the order
the scheduler lists them (running requests first, as stage 3 packs them):

- ``positions``: each row's ``num_computed_tokens`` plus ``0 .. num_new - 1``;
- ``input_ids``: gathered from the token rows at those positions;
- ``slot_mapping``: ``block_table[row, position // block_size] * block_size + position % block_size``;
- ``block_tables``: the scheduled rows, cut to the widest of them (zero past each row's blocks).

The only Python left per step is a loop over the scheduled requests (not their tokens or
blocks) to read how far each has got. The arrays are numpy views on the CPU; the finished
tensors go to the model's device.

vLLM: ``InputBatch`` in ``vllm/v1/worker/gpu_input_batch.py`` (``token_ids_cpu``,
``add_request``, ``remove_request``), ``BlockTable`` in ``vllm/v1/worker/block_table.py``
(``append_row``, ``compute_slot_mapping``), and ``_update_states`` / ``_prepare_inputs`` in
``vllm/v1/worker/gpu_model_runner.py``. vLLM also keeps its rows dense (``condense``) and its
sampling parameters in the rows; here free rows are reused as they come and the sampler
reads each request.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.model_runner import ScheduledBatch, StepInputs
from shared.request import Request, RequestStatus
from stage2_paged.attention import PagedAttentionMetadata
from stage3_continuous.scheduler import SchedulerOutput

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32}
INITIAL_TOKENS_PER_ROW = 2048  # (or max_model_len if shorter); rows widen, doubling, when a longer request arrives


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 device: torch.device | str = "cpu"):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = torch.device(device)
        self.token_ids = np.zeros((0, 0), dtype=np.int32)  # [rows, tokens]
        self.block_table = np.zeros((0, 0), dtype=np.int32)  # [rows, blocks]
        self.num_tokens: list[int] = []  # per row: token ids written
        self.num_blocks: list[int] = []  # per row: block ids written
        self.requests: list[Request | None] = []  # per row: its request, None when free
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []
        self._resize(max_num_reqs, min(max_model_len, INITIAL_TOKENS_PER_ROW))

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    # ---- rows in and out -------------------------------------------------------------------
    def add_request(self, request: Request, block_ids: list[int]) -> int:
        """Give ``request`` a row holding all its tokens and blocks (replacing any row it had)."""
        self.remove_request(request.request_id)
        if not self.free_rows:
            self._reclaim_rows()
        if not self.free_rows:
            self._resize(2 * self.num_rows, self.token_ids.shape[1])
        row = self.free_rows.pop()
        num_tokens = request.num_tokens
        self._fit(num_tokens, len(block_ids))
        self.token_ids[row, :num_tokens] = request.all_token_ids
        self.block_table[row, :self.num_blocks[row]] = 0
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self.num_tokens[row] = num_tokens
        self.requests[row] = request
        self.row_of[request.request_id] = row
        return row

    def remove_request(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.requests[row] = None
            self.free_rows.append(row)

    def _reclaim_rows(self) -> None:
        """Free the rows of requests that stopped running without being reported (a step that
        scheduled no tokens is never executed, so the requests it reported as finished or
        preempted are not seen here)."""
        for request in list(filter(None, self.requests)):
            if request.status != RequestStatus.RUNNING:
                self.remove_request(request.request_id)

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
        self.num_blocks += [0] * (num_rows - old_rows)
        self.num_tokens += [0] * (num_rows - old_rows)
        self.requests += [None] * (num_rows - old_rows)
        self.free_rows = list(range(num_rows - 1, old_rows - 1, -1)) + self.free_rows

    # ---- one step --------------------------------------------------------------------------
    def prepare(self, output: SchedulerOutput) -> tuple[ScheduledBatch, StepInputs, PagedAttentionMetadata]:
        """Bring the rows up to date with ``output`` and gather the step's inputs from them."""
        for request_id in output.finished_req_ids | output.preempted_req_ids:
            self.remove_request(request_id)
        num_scheduled, block_tables = output.num_scheduled_tokens, output.block_tables
        requests_now = output.scheduled_reqs
        counts = [num_scheduled[request.request_id] for request in requests_now]
        starts = [request.num_computed_tokens for request in requests_now]
        rows = []
        token_rows, token_cols, token_values = [], [], []  # what the rows gained since their last step
        block_rows, block_cols, block_values = [], [], []
        row_of, requests, num_tokens, num_blocks = self.row_of, self.requests, self.num_tokens, self.num_blocks
        token_width, block_width = self.token_ids.shape[1], self.block_table.shape[1]
        widest = 0
        for request in requests_now:
            request_id = request.request_id
            table = block_tables[request_id]
            all_token_ids = request.all_token_ids
            total, blocks = len(all_token_ids), len(table)
            row = row_of.get(request_id)
            if row is None or requests[row] is not request or total > token_width or blocks > block_width:
                row = self.add_request(request, table)  # new, resumed, an id taken again, or a longer row
                token_width, block_width = self.token_ids.shape[1], self.block_table.shape[1]
            else:  # a running request: write the tokens and blocks it gained since its last step
                have = num_tokens[row]
                if total == have + 1:  # a decode: the token sampled last step
                    token_rows.append(row)
                    token_cols.append(have)
                    token_values.append(all_token_ids[have])
                    num_tokens[row] = total
                elif total > have:
                    token_rows += [row] * (total - have)
                    token_cols.extend(range(have, total))
                    token_values.extend(all_token_ids[have:total])
                    num_tokens[row] = total
                written = num_blocks[row]
                if blocks > written:
                    block_rows += [row] * (blocks - written)
                    block_cols.extend(range(written, blocks))
                    block_values.extend(table[written:])
                    num_blocks[row] = blocks
            rows.append(row)
            if blocks > widest:
                widest = blocks
        if token_values:
            self.token_ids[token_rows, token_cols] = token_values
        if block_values:
            self.block_table[block_rows, block_cols] = block_values
        # A request samples when this step reaches its last known token (not mid-way through a prefill).
        sample_rows = [i for i, (request, start, count) in enumerate(zip(requests_now, starts, counts))
                       if start + count == len(request.all_token_ids)]
        batch = list(zip(requests_now, counts))
        return batch, *self._gather(rows, counts, starts, sample_rows, widest)

    def _gather(self, rows: list[int], num_new: list[int], starts: list[int], sample_rows: list[int],
                width: int) -> tuple[StepInputs, PagedAttentionMetadata]:
        rows_a = np.array(rows, dtype=np.int64)
        counts = np.array(num_new, dtype=np.int64)
        first = np.array(starts, dtype=np.int64)
        ends = np.cumsum(counts)
        if int(ends[-1]) == len(rows):  # decodes only: one token per row, at its next position
            token_rows, positions = rows_a, first
        else:
            token_rows = np.repeat(rows_a, counts)
            positions = np.repeat(first - (ends - counts), counts) + np.arange(int(ends[-1]))
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
