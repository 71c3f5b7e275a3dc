"""Stage1's static-batching loop on a paged KV cache.

Only the memory layout changes. Admission asks whether the blocks the request can ever
need (prompt plus ``max_tokens``, rounded up to whole blocks) fit beside what the batch
already holds or has been promised; blocks are then taken one at a time as each
sequence grows, and a finished request returns its blocks at once.
"""

from __future__ import annotations

import torch

from shared.model import DecoderModel
from shared.model_runner import ScheduledBatch, StepInputs
from shared.request import Request
from stage1_naive.engine import NaiveEngineCore
from stage2_paged.attention import PagedAttentionBackend, PagedAttentionMetadata, build_paged_metadata
from stage2_paged.block_table import BlockAllocator, BlockTable
from stage2_paged.kv_cache import PagedKVCache


class PagedEngineCore(NaiveEngineCore):
    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, allocator: BlockAllocator, max_num_seqs: int,
                 max_model_len: int, device: torch.device, seed: int = 0):
        self.allocator = allocator
        self.block_size = kv_cache.block_size
        self.block_tables: dict[str, BlockTable] = {}
        self.promised: dict[str, int] = {}  # blocks a running request may still take
        super().__init__(model, kv_cache, max_num_seqs, max_model_len, device, seed)

    def kv_cache_usage(self) -> float:
        return 1 - self.allocator.num_free / self.allocator.num_blocks

    def live_block_ids(self) -> dict[str, list[int]]:
        return {rid: list(t.block_ids) for rid, t in self.block_tables.items()}

    def _make_attention_backend(self):
        return PagedAttentionBackend(self.kv_cache)

    def _reserve(self, request: Request) -> bool:
        final_len = request.num_prompt_tokens + request.max_output_tokens(self.max_model_len)
        need = -(-final_len // self.block_size)
        if need > self.allocator.num_free - sum(self.promised.values()):
            return False
        self.block_tables[request.request_id] = BlockTable(self.block_size)
        self.promised[request.request_id] = need
        return True

    def _attention_metadata(self, scheduled: ScheduledBatch, inputs: StepInputs) -> PagedAttentionMetadata:
        slots: list[int] = []
        tables = []
        for request, num_new in scheduled:
            table = self.block_tables[request.request_id]
            start = request.num_computed_tokens
            new_blocks = table.grow(start + num_new, self.allocator)  # blocks as the sequence grows
            self.promised[request.request_id] -= len(new_blocks)
            slots.extend(table.slot_mapping(start, start + num_new))
            tables.append(table.block_ids)
        return build_paged_metadata(slots, inputs.query_start_loc, inputs.seq_lens, tables, self.device)

    def _on_finished(self, request: Request) -> None:
        """Unlike a slab reservation, blocks go back to the pool the moment a request ends."""
        table = self.block_tables.pop(request.request_id, None)
        if table is not None:
            self.allocator.free(table.block_ids)
            self.promised.pop(request.request_id)

    def _release(self, request: Request) -> None:
        self._on_finished(request)
