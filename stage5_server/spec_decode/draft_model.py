"""A draft model: a smaller model with the target's vocabulary proposes ``k`` tokens greedily.

It needs a forward pass and a KV cache of its own, so it lives on the worker, next to the target,
and runs right after the target's step:

1. **Catch up.** The draft runs the very positions the target just ran (the same input ids,
   positions, slots and attention metadata), writing its own K/V into its own paged cache. Its
   cache is indexed by the same block tables as the target's, so whatever the target's cache
   holds, the draft's holds too: a prefix-cache hit, a preempted request recomputed, a chunk of a
   prefill, the positions of rejected drafts (written now, overwritten when the scheduler
   recomputes them, as the target's are).
2. **Propose.** For each request that sampled, ``k`` one-position decodes of the draft: the last
   token sampled, then each draft in turn, the argmax each time. Their K/V goes where those
   positions will live; a position past the request's last block goes to a scratch block of the
   draft's cache (``num_scratch_blocks`` per request, never counted in the pool), since the
   scheduler has not allocated it yet. Either way the next step's catch-up writes it again
   before anything reads it as context.

Greedy drafts are point masses, so the runner's accept-while-equal rule verifies them and the
output keeps the target's distribution for any sampling parameters
(``rejection_sampler.py``). The pool accounting counts the draft's bytes per token
(``Worker.kv_bytes_per_token``), so the same memory holds fewer blocks.

vLLM: ``vllm/v1/spec_decode/draft_model.py`` and ``eagle.py`` (``propose``, run by
``GPUModelRunner`` after sampling); its draft has a KV cache group of its own.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.model import DecoderModel
from stage2_paged.attention import PagedAttentionMetadata
from stage2_paged.kv_cache import PagedKVCache


class DraftModelProposer:
    def __init__(self, model: DecoderModel, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 max_num_reqs: int, dtype: torch.dtype, device: torch.device, backend_class):
        config = model.config
        self.model, self.k, self.block_size, self.device = model, num_speculative_tokens, block_size, device
        self.num_blocks = num_blocks  # the pool's; scratch blocks follow them
        self.num_scratch_blocks = -(-num_speculative_tokens // block_size)
        total = num_blocks + max_num_reqs * self.num_scratch_blocks
        self.kv_cache = PagedKVCache(total, block_size, config.num_hidden_layers, config.num_key_value_heads,
                                     config.head_dim, dtype, device)
        model.set_attention_backend(backend_class(self.kv_cache))

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata) -> None:
        """Write the draft's K/V at the positions the target's step just ran."""
        self.model(input_ids, positions, meta)

    def propose(self, block_table: np.ndarray, num_blocks: list[int], rows: list[int], last_positions: list[int],
                last_tokens: list[int], num_drafts: int | None = None) -> list[list[int]]:
        """``num_drafts`` (at most ``k``) greedy drafts for each request, given its input-batch row, the
        position of the token it sampled last and that token."""
        n, bs, k = len(rows), self.block_size, self.k if num_drafts is None else min(num_drafts, self.k)
        positions = np.array(last_positions, dtype=np.int64)
        width = int((positions.max() + self.k - 1) // bs + 1)
        table = np.zeros((n, width), dtype=np.int64)
        for i, row in enumerate(rows):
            needed = int((positions[i] + self.k - 1) // bs + 1)
            real = min(num_blocks[row], needed)
            extra = needed - real  # the last token sampled lies inside its blocks, so at most ceil(k / bs)
            assert extra <= self.num_scratch_blocks, f"row {row}: {extra} blocks past its own"
            table[i, :real] = block_table[row, :real]
            table[i, real:needed] = self.num_blocks + i * self.num_scratch_blocks + np.arange(extra)
        tokens = torch.tensor(last_tokens, dtype=torch.long)
        drafts = []
        query_start_loc = torch.arange(n + 1, dtype=torch.int32)
        tables = torch.from_numpy(table.astype(np.int32))
        for j in range(k):
            pos = positions + j
            slots = table[np.arange(n), pos // bs] * bs + pos % bs
            meta = PagedAttentionMetadata(
                slot_mapping=torch.from_numpy(slots).to(self.device), query_start_loc=query_start_loc.to(self.device),
                seq_lens=torch.from_numpy((pos + 1).astype(np.int32)).to(self.device),
                block_tables=tables.to(self.device), max_query_len=1, max_seq_len=int(pos.max()) + 1)
            hidden = self.model(tokens.to(self.device), torch.from_numpy(pos).to(self.device), meta)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).cpu()
            drafts.append(tokens.tolist())
        return [list(column) for column in zip(*drafts)]
