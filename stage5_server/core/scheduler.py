"""stage 4's scheduler, with three additions for an engine whose workers may live in other processes.

1. **Several new tokens per request per step.** A running request may carry draft tokens
   (``Request.spec_token_ids``): a decode then asks for ``1 + k`` positions inside the same token
   budget and KV allocation, and the drafts go to the workers in
   ``SchedulerOutput.scheduled_spec_decode_tokens``. The runner returns the accepted drafts plus one
   token; ``update_from_output`` rolls ``num_computed_tokens`` back past the rejected positions, so
   their KV slots are written again by the next step and never read. The prefix cache hashes only
   known tokens (``KVCacheManager.allocate_slots``), so drafts never enter a block hash.
2. **Images in a prompt**: the KV cache manager puts each image's hash into the blocks its
   placeholders overlap (``multimodal/kv_cache.py``), and a new request carries its images to the
   workers, which compute their features (``multimodal/encoder.py``).
3. **The workers' view of the step** (``runner_input``): the plain-data ``ModelRunnerInput`` every
   rank receives, sending a request whole once and afterwards only what it gained; and the
   structured-output masks of the requests that sample, computed here where the grammars live.
3. **Batches in flight.** Under pipeline parallelism the core schedules the next batch before the
   last one's tokens are back; a request in a batch still in flight (``in_flight``) sits that
   batch out, so a request is never in two batches at once and never preempted under one.
4. **At most ``max_loras`` adapters at once.** The workers hold that many LoRA adapters in slots
   (``lora/``): a waiting request whose adapter would be one too many among the running requests
   waits, and the requests behind it go first, as vLLM's scheduler skips it. Every step's requests are
   running ones, so no step needs more slots than there are.

vLLM: ``vllm/v1/core/sched/scheduler.py`` (``num_tokens_with_spec``, the rejected-token rollback in
``update_from_output``, ``get_grammar_bitmask``, the ``max_loras`` check in ``schedule``) and
``vllm/v1/core/sched/output.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from shared.request import Request
from stage3_continuous.config import SchedulerConfig
from stage4_prefix_cache.scheduler import CacheConfig
from stage4_prefix_cache.scheduler import Scheduler as _PrefixCachingScheduler
from stage4_prefix_cache.scheduler import SchedulerOutput as _SchedulerOutput
from stage5_server.multimodal.kv_cache import MultiModalKVCacheManager
from stage5_server.worker.runner_io import CachedRequestData, ModelRunnerInput, NewRequestData


class BlockTables(Mapping):
    """The scheduled requests' block tables as physical block ids, each built when first read: the
    workers are sent only the blocks a request gained (``runner_input``), so most steps read none."""

    def __init__(self, kv_cache_manager, request_ids):
        self.kv_cache_manager, self.request_ids, self.built = kv_cache_manager, request_ids, {}

    def __getitem__(self, request_id: str) -> list[int]:
        if request_id not in self.request_ids:
            raise KeyError(request_id)
        if request_id not in self.built:
            self.built[request_id] = self.kv_cache_manager.get_block_ids(request_id)
        return self.built[request_id]

    def __iter__(self):
        return iter(self.request_ids)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class SchedulerOutput(_SchedulerOutput):
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts verified this step


class Scheduler(_PrefixCachingScheduler):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, max_model_len: int = 1 << 30,
                 vocab_size: int | None = None, max_loras: int | None = None):
        super().__init__(scheduler_config, cache_config, max_model_len)
        self.max_loras = max_loras  # None: no adapters served
        self.vocab_size = vocab_size  # the width of a structured-output mask (the builder passes the model's)
        self.sent_to_workers: dict[str, list[int]] = {}  # request id -> [tokens, blocks] the workers hold
        self.finished_on_workers: set[str] = set()  # to tell the workers with the next executed step
        self.preempted_on_workers: set[str] = set()
        self.in_flight: set[str] = set()  # requests in a batch the workers have not answered yet
        self.set_aside: list[Request] = []  # the running ones of them, while a batch is scheduled

    def _make_kv_cache_manager(self, cache_config: CacheConfig):
        """Stage 4's manager, with each image's hash in the blocks it overlaps (``multimodal/kv_cache.py``)."""
        if not isinstance(cache_config, CacheConfig):  # a stage 3 config: caching stays off
            return super()._make_kv_cache_manager(cache_config)
        return MultiModalKVCacheManager(cache_config.block_size, cache_config.num_blocks,
                                        enable_caching=cache_config.enable_prefix_caching,
                                        hash_fn=cache_config.prefix_caching_hash_algo,
                                        shuffle_seed=cache_config.shuffle_seed)

    def _block_tables(self, request_ids) -> BlockTables:
        return BlockTables(self.kv_cache_manager, dict.fromkeys(request_ids))

    # ---- adapters ------------------------------------------------------------------------------
    def _peek_waiting(self) -> Request | None:
        """Stage 3's choice among the waiting requests whose adapter fits beside the running ones'."""
        if self.max_loras is None:
            return super()._peek_waiting()
        running = {r.lora_request for r in self.running if r.lora_request is not None}
        room = len(running) < self.max_loras
        ready = (r for r in self.waiting if not r.waiting_for_grammar
                 and (r.lora_request is None or room or r.lora_request in running))
        if self.config.policy == "priority":
            return min(ready, key=lambda r: (r.priority, r.arrival_time), default=None)
        return next(ready, None)

    # ---- several tokens per step -------------------------------------------------------------
    def _num_tokens_to_compute(self, request: Request) -> int:
        num_new = len(request.all_token_ids) - request.num_computed_tokens
        if num_new == 1 and request.spec_token_ids:  # a decode that also verifies its drafts
            return 1 + len(request.spec_token_ids)
        return num_new

    def add_draft_tokens(self, request: Request, draft_token_ids: list[int]) -> None:
        """Propose ``draft_token_ids`` to follow ``request``'s last token; verified in its next decode.
        Cut to what ``max_model_len`` and ``max_tokens`` leave (a step gains at most one token more than
        it has drafts) and, under a grammar, to the drafts it allows (vLLM's ``validate_tokens``). Only a
        request whose next step is a decode takes drafts."""
        room = min(self.max_model_len - request.num_tokens,
                   request.max_output_tokens(self.max_model_len) - request.num_output_tokens - 1)
        decoding = not request.is_finished and request.num_tokens - request.num_computed_tokens == 1
        drafts = list(draft_token_ids[:max(0, room)]) if decoding else []  # mid-prefill: none
        grammar = request.structured_output_request
        if drafts and grammar is not None:
            drafts = drafts[:grammar.num_valid_drafts(request.output_token_ids, drafts)]
        request.spec_token_ids = drafts

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []  # proposed for a position the recompute samples afresh
        super()._preempt(request)

    # ---- batches in flight ---------------------------------------------------------------------
    def _num_running(self) -> int:
        return len(self.running) + len(self.set_aside)

    def schedule(self) -> SchedulerOutput:
        """The next batch. A request whose last batch is still in flight (``in_flight``, under pipeline
        parallelism) is set aside: not scheduled, not preempted (its blocks are in use), still counted."""
        running = self.running
        self.set_aside = [r for r in running if r.request_id in self.in_flight]
        if self.set_aside:
            self.running = [r for r in running if r.request_id not in self.in_flight]
        try:
            base = self._schedule_with_drafts()
        finally:
            if self.set_aside:  # back in admission order: the set-aside ones where they were, new ones last
                place = {id(r): i for i, r in enumerate(running)}
                self.running = sorted(self.set_aside + self.running,
                                      key=lambda r: place.get(id(r), len(place)))
            self.set_aside = []
        return base

    def _schedule_with_drafts(self) -> SchedulerOutput:
        base = super().schedule()
        drafts = {}
        for request in base.scheduled_running_reqs:
            if request.spec_token_ids:
                num_drafts = base.num_scheduled_tokens[request.request_id] - 1  # the budget may cut some
                if num_drafts > 0:
                    drafts[request.request_id] = request.spec_token_ids[:num_drafts]
                request.spec_token_ids = []
        self.finished_on_workers |= base.finished_req_ids
        self.preempted_on_workers |= base.preempted_req_ids
        return SchedulerOutput(**vars(base), scheduled_spec_decode_tokens=drafts)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        rejected = {}
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            tokens = sampled_token_ids.get(rid)
            if tokens:  # none: aborted while its step ran
                rejected[rid] = len(drafts) + 1 - len(tokens)
                self.counters.observe_draft(len(drafts), len(tokens) - 1)
        updated = super().update_from_output(scheduler_output, sampled_token_ids)
        for rid, num_rejected in rejected.items():
            request = self.requests.get(rid)  # gone if it finished
            if request is not None and num_rejected > 0:
                request.num_computed_tokens -= num_rejected
        return updated

    # ---- the workers' view ---------------------------------------------------------------------
    def runner_input(self, output: SchedulerOutput) -> ModelRunnerInput:
        """What every worker needs to run ``output``: new requests whole, running ones as deltas."""
        sent = self.sent_to_workers
        finished, preempted = self.finished_on_workers, self.preempted_on_workers
        for request_id in finished | preempted:
            sent.pop(request_id, None)
        new_reqs, new_counts = [], []
        cached, cached_counts = CachedRequestData(), []
        num_scheduled, tables = output.num_scheduled_tokens, self.kv_cache_manager.req_to_blocks
        for request in output.scheduled_reqs:
            request_id = request.request_id
            blocks = tables[request_id]
            have = sent.get(request_id)
            if have is None:
                new_reqs.append(NewRequestData(
                    request_id, request.prompt_token_ids, request.output_token_ids, request.sampling_params,
                    request.eos_token_ids, request.bad_words_token_ids, [b.block_id for b in blocks],
                    request.num_computed_tokens, len(request.prompt_logprobs), request.mm_features,
                    request.lora_request))
                new_counts.append(num_scheduled[request_id])
                sent[request_id] = [request.num_tokens, len(blocks)]
            else:
                num_tokens, num_blocks = have
                cached.req_ids.append(request_id)
                cached.new_token_ids.append(request.all_token_ids[num_tokens:])
                cached.new_block_ids.append([b.block_id for b in blocks[num_blocks:]] if len(blocks) > num_blocks
                                            else [])
                cached.num_computed_tokens.append(request.num_computed_tokens)
                cached_counts.append(num_scheduled[request_id])
                have[0], have[1] = request.num_tokens, len(blocks)
        req_ids = cached.req_ids + [new.req_id for new in new_reqs]  # the order the workers pack them in
        self.finished_on_workers, self.preempted_on_workers = set(), set()
        runner_input = ModelRunnerInput(new_reqs, cached, cached_counts + new_counts, req_ids,
                                        output.scheduled_spec_decode_tokens, finished, preempted)
        self._add_grammar_bitmask(output, runner_input)
        return runner_input

    def runner_input_failed(self, runner_input: ModelRunnerInput) -> None:
        """The step carrying ``runner_input`` raised before the workers took it: tell them again."""
        self.finished_on_workers |= runner_input.finished_req_ids
        self.preempted_on_workers |= runner_input.preempted_req_ids

    def _add_grammar_bitmask(self, output: SchedulerOutput, runner_input: ModelRunnerInput) -> None:
        """The masks of the requests with a grammar that sample this step (they reach their last token):
        one row per position that samples, so ``1 + len(drafts)`` rows for a request verifying drafts."""
        sampling = [r for r in output.scheduled_reqs if r.structured_output_request is not None
                    and r.num_computed_tokens + output.num_scheduled_tokens[r.request_id] >= r.num_tokens]
        if not sampling:
            return
        if self.vocab_size is None:
            raise ValueError("vocab_size: a scheduler of requests with structured output needs the model's vocab_size")
        drafts = [output.scheduled_spec_decode_tokens.get(r.request_id, []) for r in sampling]
        words = -(-self.vocab_size // 32)
        bitmask = torch.full((sum(1 + len(d) for d in drafts), words), -1, dtype=torch.int32)  # -1: all allowed
        row = 0
        for request, request_drafts in zip(sampling, drafts):
            request.structured_output_request.fill_bitmask(bitmask, row, request.output_token_ids, request_drafts)
            row += 1 + len(request_drafts)
        runner_input.grammar_bitmask = bitmask
        runner_input.grammar_req_ids = [r.request_id for r in sampling]
