"""A draft model: a smaller model with the target's vocabulary proposes the next ``k`` tokens.

It needs a forward pass and a KV cache of its own, so it lives on the worker, next to the target,
and runs right after the target's step, for the requests the draft-length policy asks drafts of:

1. **Catch up, then the first draft.** The draft's cache is indexed by the same block tables as
   the target's, and the proposer remembers, per request, up to which position its own K/V is
   written. Its first forward pass runs every position from there to the token just sampled (a
   chunk, as in a chunked prefill: a whole prompt the first time, the tokens accepted since the
   last proposal after that) and drafts from the logits at the last one. A request the policy
   leaves without drafts costs the draft nothing: its positions wait for the next proposal that
   needs them.
2. **The other drafts.** ``k - 1`` one-position decodes, each draft in turn. Their K/V goes where
   those positions will live; a position past the request's last block goes to a scratch block
   of the draft's cache (``num_scratch_blocks`` per request, never counted in the pool), since
   the scheduler has not allocated it yet. Either way those positions lie past what the proposer
   counts as written, so the next catch-up writes them again before anything reads them as
   context.

A request that comes back after preemption, or one new to the worker (a prefix-cache hit
included), starts from position 0: the blocks it shares may never have been run by the draft.

Each draft is the argmax for a greedy request, and for a request that samples a draw from the
draft's own distribution under the request's temperature, min-p, top-k and top-p. A greedy
draft is a point mass, verified by the runner's accept-while-equal rule; a sampled one comes
back with the distribution it was drawn from, and the runner verifies it by the rejection rule
(``rejection_sampler.py``). Either way the output keeps the target's distribution. The pool
accounting counts the draft's bytes per token (``Worker.kv_bytes_per_token``), so the same
memory holds fewer blocks.

vLLM: ``vllm/v1/spec_decode/draft_model.py`` and ``eagle.py`` (``propose``, run by
``GPUModelRunner`` after sampling); its draft has a KV cache group of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from shared.model import DecoderModel
from shared.named_models import resolve_model
from shared.sampler import draw, sampling_probs
from shared.weights import load_model
from stage2_paged.attention import PagedAttentionMetadata
from stage2_paged.kv_cache import PagedKVCache
from stage5_server.model import fuse_projections

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig


def load_draft_model(config: EngineConfig, device: torch.device) -> DecoderModel | None:
    """``speculative_config``'s draft model, rearranged as the target is; None without one (one rank:
    ``EngineConfig`` refuses a draft model for a split target)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    return fuse_projections(load_model(resolve_model(spec.model), config.dtype, device)[0])


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
        self.num_computed: dict[str, int] = {}  # per request: positions whose draft K/V is written
        # Sampled drafts until verified: request id -> (drafts, the distributions they were drawn from)
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    def forget(self, request_ids) -> None:
        """Drop what is known of these requests' draft K/V (finished, preempted, or new to the worker)."""
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)
            self.draft_probs.pop(request_id, None)

    def take_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The distributions ``drafts`` were drawn from (the scheduler may have cut them), or None: drafts
        without probabilities (greedy), or not this proposer's."""
        proposed = self.draft_probs.pop(request_id, None) if drafts else None
        if proposed is None or proposed[0][:len(drafts)] != drafts:
            return None
        return proposed[1][:len(drafts)]

    def propose_after_step(self, input_batch, req_ids: list[str], sampled_token_ids: list[list[int]],
                           num_drafts: dict[str, int] | None, generator: torch.Generator) -> dict[str, list[int]]:
        """The next drafts of each request that sampled this step, wants some (``num_drafts``: the core's
        policy; None: ``k`` for all) and has room for them, read from the runner's input batch."""
        ids, rows, tokens, wanted = [], [], [], []
        for request_id, sampled in zip(req_ids, sampled_token_ids):
            state, row = input_batch.states[request_id], input_batch.row_of[request_id]
            position = state.num_tokens + len(sampled) - 1  # where the last token sampled goes
            want = self.k if num_drafts is None else min(self.k, num_drafts.get(request_id, self.k))
            if want > 0 and position + self.k <= input_batch.max_model_len:
                ids.append(request_id)
                wanted.append(want)
                rows.append(row)
                tokens.append(np.concatenate([input_batch.token_ids[row, :state.num_tokens], sampled]))
        if not ids:
            return {}
        states = [input_batch.states[request_id] for request_id in ids]
        drafts, probs = self.propose(input_batch.block_table, input_batch.num_blocks, rows, states, tokens,
                                     max(wanted), generator)
        for request_id, d, q, n in zip(ids, drafts, probs, wanted):
            if q is not None:
                self.draft_probs[request_id] = (d[:n], q[:n])
        return {i: d[:n] for i, d, n in zip(ids, drafts, wanted)}

    def propose(self, block_table: np.ndarray, num_blocks: np.ndarray, rows: list[int], states: list,
                token_ids: list[np.ndarray], num_drafts: int | None, generator: torch.Generator,
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """``num_drafts`` (at most ``k``) drafts for each request, given its input-batch row, its runner
        state and its tokens up to the one it sampled last; with, for a request that samples, the
        distribution each draft was drawn from (``[drafts, vocab]``; None for a greedy request)."""
        request_ids = [state.request_id for state in states]
        n, bs, k = len(rows), self.block_size, self.k if num_drafts is None else min(num_drafts, self.k)
        positions = np.array([len(tokens) - 1 for tokens in token_ids], dtype=np.int64)  # the last tokens'
        starts = np.array([min(self.num_computed.get(r, 0), p) for r, p in zip(request_ids, positions)])
        width = int((positions.max() + self.k - 1) // bs + 1)
        table = np.zeros((n, width), dtype=np.int64)
        for i, row in enumerate(rows):
            needed = int((positions[i] + self.k - 1) // bs + 1)
            real = min(int(num_blocks[row]), needed)
            extra = needed - real  # the tokens before the last one sampled lie inside its blocks
            assert extra <= self.num_scratch_blocks, f"row {row}: {extra} blocks past its own"
            table[i, :real] = block_table[row, :real]
            table[i, real:needed] = self.num_blocks + i * self.num_scratch_blocks + np.arange(extra)
        tables = torch.from_numpy(table.astype(np.int32)).to(self.device)
        # The catch-up chunk of each request, from what its draft cache holds to its last token.
        lengths = positions + 1 - starts
        pos = np.concatenate([np.arange(a, b + 1) for a, b in zip(starts, positions)])
        rows_of_pos = np.repeat(np.arange(n), lengths)
        tokens = torch.from_numpy(np.concatenate([t[a:] for t, a in zip(token_ids, starts)]).astype(np.int64))
        last_rows = torch.from_numpy(np.cumsum(lengths) - 1)
        query_start_loc = np.concatenate([[0], np.cumsum(lengths)])
        drafts, probs = [], []
        for j in range(k):
            slots = table[rows_of_pos, pos // bs] * bs + pos % bs
            meta = PagedAttentionMetadata(
                slot_mapping=torch.from_numpy(slots).to(self.device),
                query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(self.device),
                seq_lens=torch.from_numpy((positions + 1 + j).astype(np.int32)).to(self.device),
                block_tables=tables, max_query_len=int(lengths.max()) if j == 0 else 1,
                max_seq_len=int(positions.max()) + 1 + j)
            hidden = self.model(tokens.to(self.device), torch.from_numpy(pos).to(self.device), meta)
            if j == 0:
                hidden = hidden[last_rows.to(self.device)]
                for request_id, position, row in zip(request_ids, positions, rows):  # in its own blocks only
                    self.num_computed[request_id] = min(int(position) + 1, int(num_blocks[row]) * bs)
                pos, rows_of_pos, query_start_loc = positions + 1, np.arange(n), np.arange(n + 1)
            else:
                pos = pos + 1
            tokens, q = draw_drafts(self.model.compute_logits(hidden).float().cpu(), states, generator)
            drafts.append(tokens.tolist())
            probs.append(q)
        sampling = [i for i, state in enumerate(states) if not state.sampling_params.greedy]
        draft_probs: list[torch.Tensor | None] = [None] * n
        for row, i in enumerate(sampling):
            draft_probs[i] = torch.stack([q[row] for q in probs])
        return [list(column) for column in zip(*drafts)], draft_probs


def draw_drafts(logits: torch.Tensor, states: list, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft per row: the argmax for a greedy request, else a draw from the draft's distribution under
    the request's temperature, min-p, top-k and top-p (returned, one row per sampling request, for the
    rejection rule)."""
    tokens = logits.argmax(dim=-1)
    sampling = [i for i, state in enumerate(states) if not state.sampling_params.greedy]
    if not sampling:
        return tokens, None
    requests = [states[i] for i in sampling]
    q = sampling_probs(logits[sampling], requests)
    tokens[sampling] = draw(q, requests, generator)  # the very draw the sampler makes
    return tokens, q
