"""Static batching on a contiguous slab.

The engine forms a batch of up to ``max_num_seqs`` waiting requests (first come, first
served) whose ``max_model_len`` reservations fit in the slab. The batch then runs until
its last member finishes: finished members sit idle, their reservations stay held, and
newcomers wait for the whole batch to drain. Each step prefills every member that has
not been prefilled and decodes the rest, so one step is one forward pass.

The KV-specific parts are four small methods (``_reserve``, ``_attention_metadata``,
``_on_finished``, ``_release``) so that stage2 can swap the memory layout and keep this loop.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import torch

from shared.metrics import SchedulerStats
from shared.model import DecoderModel
from shared.model_runner import ModelRunner, ScheduledBatch, StepInputs, prepare_inputs
from shared.request import Request, RequestStatus, check_stop
from stage1_naive.attention import ContiguousAttentionBackend, ContiguousAttentionMetadata
from stage1_naive.kv_cache import ContiguousKVCache


class NaiveEngineCore:
    def __init__(self, model: DecoderModel, kv_cache: ContiguousKVCache, max_num_seqs: int,
                 max_model_len: int, device: torch.device, seed: int = 0):
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        self.runner = ModelRunner(model, device, seed)
        model.set_attention_backend(self._make_attention_backend())
        self.waiting: deque[Request] = deque()
        self.batch: list[Request] = []
        self.counters = SchedulerStats()

    # ---- the engine-core interface ------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.batch)

    def step(self) -> list[Request]:
        rejected = [] if self.batch else self._admit_batch()
        live = [r for r in self.batch if not r.is_finished]
        if not live:
            return rejected
        scheduled = [(r, r.num_tokens - r.num_computed_tokens) for r in live]
        inputs = prepare_inputs(scheduled, self.device)
        sampled = self.runner.execute(scheduled, inputs, self._attention_metadata(scheduled, inputs))
        now = time.monotonic()
        step_tokens = 0
        for request, num_new in scheduled:
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.counters.num_prompt_tokens_computed += num_new
                step_tokens += num_new
            self.counters.num_generation_tokens += 1
            step_tokens += 1
            request.num_computed_tokens += num_new
            request.append_output_token(sampled[request.request_id], now)
            if check_stop(request, self.max_model_len):
                self._finish(request, request.status)
        self.counters.observe_step(step_tokens)
        self._end_batch_if_done()
        return rejected + live

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        ids = set(request_ids)
        for request in [r for r in self.waiting if r.request_id in ids]:
            self.waiting.remove(request)
            request.status = status
        for request in self.batch:
            if request.request_id in ids and not request.is_finished:
                self._finish(request, status)
        self._end_batch_if_done()

    def kv_cache_usage(self) -> float:
        """Fraction of the slab reserved by live requests."""
        return self.kv_cache.reserved_slots / self.kv_cache.num_slots

    def stats(self) -> SchedulerStats:
        live = sum(not r.is_finished for r in self.batch)
        return replace(self.counters, num_running=live, num_waiting=len(self.waiting),
                       kv_cache_usage=self.kv_cache_usage())

    # ---- batching ------------------------------------------------------------------------
    def _admit_batch(self) -> list[Request]:
        """Form the next batch; return the requests refused instead (their grammar failed to compile)."""
        now = time.monotonic()
        rejected = []
        while len(self.batch) < self.max_num_seqs:
            # First come, first served, past requests whose grammar is still compiling.
            request = next((r for r in self.waiting if not r.waiting_for_grammar), None)
            if request is None or not (request.grammar_failed or self._reserve(request)):
                break  # nobody jumps the queue for memory
            self.waiting.remove(request)
            if request.grammar_failed:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                rejected.append(request)
                continue
            request.status = RequestStatus.RUNNING
            request.timeline.first_scheduled = now
            self.batch.append(request)
        return rejected

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.timeline.finished = time.monotonic()
        self._on_finished(request)

    def _end_batch_if_done(self) -> None:
        if self.batch and all(r.is_finished for r in self.batch):
            for request in self.batch:
                self._release(request)
            self.batch = []

    # ---- the KV layout: what stage2 replaces ----------------------------------------------
    def _make_attention_backend(self):
        return ContiguousAttentionBackend(self.kv_cache)

    def _reserve(self, request: Request) -> bool:
        """Every request reserves its worst case, ``max_model_len`` slots, up front."""
        return self.kv_cache.reserve(request.request_id, self.max_model_len) is not None

    def _attention_metadata(self, scheduled: ScheduledBatch, inputs: StepInputs) -> ContiguousAttentionMetadata:
        starts = [self.kv_cache.start_of(r.request_id) for r, _ in scheduled]
        slots = [start + pos for (r, n), start in zip(scheduled, starts)
                 for pos in range(r.num_computed_tokens, r.num_computed_tokens + n)]
        for (request, num_new) in scheduled:
            self.kv_cache.mark_written(request.request_id, request.num_computed_tokens + num_new)
        return ContiguousAttentionMetadata(torch.tensor(slots, device=self.device), inputs.query_start_loc,
                                           inputs.seq_lens, starts)

    def _on_finished(self, request: Request) -> None:
        """A finished member keeps its reservation until the whole batch ends."""

    def _release(self, request: Request) -> None:
        self.kv_cache.release(request.request_id)
