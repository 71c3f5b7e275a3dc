"""Stage 4's scheduler, for an engine whose workers may live in other processes.

1. **The workers' view of the step.** ``schedule()`` takes stage 4's decision and describes it as the
   plain-data ``SchedulerOutput`` every rank receives (``stage5_server/outputs.py``): a request whole the
   first time, afterwards only what it gained; with the structured-output masks of the requests that
   sample, computed here, where the grammars live. ``update_from_output`` takes the runner's answer,
   puts tokens and logprobs on the requests and returns the ``EngineCoreOutput`` of each request that
   changed: the front end's message, built where the tokens are appended.
2. **Several new tokens per request per step.** A running request may carry draft tokens
   (``Request.spec_token_ids``): a decode then asks for ``1 + k`` positions inside the same token
   budget and KV allocation, and the drafts go to the workers in ``scheduled_spec_decode_tokens``.
   The runner returns the accepted drafts plus one token; ``update_from_output`` rolls
   ``num_computed_tokens`` back past the rejected positions, so their KV slots are written again by
   the next step and never read. The prefix cache hashes only known tokens, so drafts never enter a
   block hash.
3. **Batches in flight.** Under pipeline parallelism the core schedules the next batch before the
   last one's tokens are back; a request in a batch still in flight (``in_flight``) sits that
   batch out, so a request is never in two batches at once and never preempted under one.
4. **A KV connector's part of each step** (``kv_transfer/``): the manager asks the connector during
   a prefix lookup; ``schedule`` then lets it describe the step's copies (``kv_connector_metadata``),
   from the blocks the step completes.
5. **At most ``max_loras`` adapters at once.** The workers hold that many LoRA adapters in slots
   (``lora/``): a waiting request whose adapter would be one too many among the running requests
   waits, and the requests behind it go first, as vLLM's scheduler skips it.

The KV cache manager is stage 4's; with adapters, images or a KV connector on, stage 5's, which adds
their keys to each block's hash (an adapter's, an image's) and asks the connector (``kv_cache_manager.py``).

vLLM: ``vllm/v1/core/sched/scheduler.py`` (``schedule``'s ``NewRequestData`` / ``CachedRequestData``,
``num_tokens_with_spec``, the rejected-token rollback and the outputs in ``update_from_output``,
``get_grammar_bitmask``, the ``max_loras`` check).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from stage3_continuous.config import SchedulerConfig
from stage4_prefix_cache.scheduler import CacheConfig
from stage4_prefix_cache.scheduler import Scheduler as _PrefixCachingScheduler
from stage4_prefix_cache.scheduler import SchedulerOutput as _LiveSchedulerOutput
from stage5_server.core.kv_cache_manager import KVCacheManager
from stage5_server.core.messages import EngineCoreOutput
from stage5_server.core.request import Request
from stage5_server.core.stats import SchedulerStats
from stage5_server.kv_transfer import KVConnectorBase
from stage5_server.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from stage5_server.spec_decode.grammar import fill_bitmask_with_drafts, num_valid_drafts


class Scheduler(_PrefixCachingScheduler):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, max_model_len: int = 1 << 30,
                 vocab_size: int | None = None, max_loras: int | None = None,
                 kv_connector: KVConnectorBase | None = None, takes_images: bool = False):
        self.kv_connector = kv_connector  # None: no KV connector (kv_transfer/)
        self.max_loras = max_loras  # None: no adapters served
        self.takes_images = takes_images  # a vision-language model: images key their blocks (multimodal/)
        super().__init__(scheduler_config, cache_config, max_model_len)
        if kv_connector is not None:
            self.kv_cache_manager.kv_connector = kv_connector
        self.vocab_size = vocab_size  # the width of a structured-output mask (the builder passes the model's)
        self.sent_to_workers: dict[str, list[int]] = {}  # request id -> [tokens, blocks] the workers hold
        self.finished_on_workers: set[str] = set()  # to tell the workers with the next executed step
        self.preempted_on_workers: set[str] = set()
        self.in_flight: set[str] = set()  # requests in a batch the workers have not answered yet
        self.set_aside: list[Request] = []  # the running ones of them, while a batch is scheduled
        self.finished_outputs: list[EngineCoreOutput] = []  # of requests finished outside a step
        self.counters = SchedulerStats()  # stage 4's, with speculative decoding's counters

    def _make_kv_cache_manager(self, cache_config: CacheConfig):
        """Stage 4's manager, unless adapters, images or a KV connector need stage 5's (chosen at start-up)."""
        plain = self.max_loras is None and not self.takes_images and self.kv_connector is None
        if plain or not isinstance(cache_config, CacheConfig):  # a stage 3 config: caching stays off
            return super()._make_kv_cache_manager(cache_config)
        return KVCacheManager(cache_config.block_size, cache_config.num_blocks,
                              enable_caching=cache_config.enable_prefix_caching,
                              hash_fn=cache_config.prefix_caching_hash_algo, shuffle_seed=cache_config.shuffle_seed)

    def _block_tables(self, request_ids) -> dict[str, list[int]]:
        return {}  # the workers get each request's block ids in its new or cached data instead

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
            drafts = drafts[:num_valid_drafts(grammar, request.output_token_ids, drafts)]
        request.spec_token_ids = drafts

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []  # proposed for a position the recompute samples afresh
        super()._preempt(request)

    # ---- batches in flight ---------------------------------------------------------------------
    def _num_running(self) -> int:
        return len(self.running) + len(self.set_aside)

    def schedule(self) -> SchedulerOutput:
        """The next batch, for the workers. A request whose last batch is still in flight (``in_flight``,
        under pipeline parallelism) is set aside: not scheduled, not preempted (its blocks are in use),
        still counted."""
        running = self.running
        self.set_aside = [r for r in running if r.request_id in self.in_flight]
        if self.set_aside:
            self.running = [r for r in running if r.request_id not in self.in_flight]
        try:
            live = super().schedule()
        finally:
            if self.set_aside:  # back in admission order: the set-aside ones where they were, new ones last
                place = {id(r): i for i, r in enumerate(running)}
                self.running = sorted(self.set_aside + self.running, key=lambda r: place.get(id(r), len(place)))
            self.set_aside = []
        self.finished_outputs += [EngineCoreOutput.from_request(r, 0) for r in live.aborted_reqs]
        self.finished_on_workers |= live.finished_req_ids
        self.preempted_on_workers |= live.preempted_req_ids
        if live.total_num_scheduled_tokens == 0:  # nothing runs: the workers hear of these with the next step
            return SchedulerOutput([], CachedRequestData(), {}, 0)
        output = self._for_workers(live)
        self._add_grammar_bitmask(live, output)
        if self.kv_connector is not None:
            filled = [block for request in live.scheduled_reqs for block in
                      self.kv_cache_manager.filled_blocks(request, live.num_scheduled_tokens[request.request_id])]
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(filled)
        return output

    def _for_workers(self, live: _LiveSchedulerOutput) -> SchedulerOutput:
        """Stage 4's decision as the workers receive it: new requests whole, running ones as what they gained."""
        sent = self.sent_to_workers
        finished, preempted = self.finished_on_workers, self.preempted_on_workers
        for request_id in finished | preempted:
            sent.pop(request_id, None)
        new_reqs, cached, tables = [], CachedRequestData(), self.kv_cache_manager.req_to_blocks
        drafts: dict[str, list[int]] = {}
        for request in live.scheduled_running_reqs:
            request_id = request.request_id
            if request.spec_token_ids:  # the budget may have cut some of them
                num_drafts = live.num_scheduled_tokens[request_id] - 1
                if num_drafts > 0:
                    drafts[request_id] = request.spec_token_ids[:num_drafts]
                request.spec_token_ids = []
        for request in live.scheduled_reqs:
            request_id = request.request_id
            blocks = tables[request_id]
            have = sent.get(request_id)
            if have is None:
                new_reqs.append(NewRequestData(
                    request_id, request.prompt_token_ids, request.output_token_ids, request.sampling_params,
                    request.eos_token_ids, request.bad_words_token_ids, [b.block_id for b in blocks],
                    request.num_computed_tokens, len(request.prompt_logprobs), request.mm_features,
                    request.lora_request))
                sent[request_id] = [request.num_tokens, len(blocks)]
            else:
                num_tokens, num_blocks = have
                cached.req_ids.append(request_id)
                cached.new_token_ids.append(request.all_token_ids[num_tokens:])
                cached.new_block_ids.append([b.block_id for b in blocks[num_blocks:]] if len(blocks) > num_blocks
                                            else [])
                cached.num_computed_tokens.append(request.num_computed_tokens)
                have[0], have[1] = request.num_tokens, len(blocks)
        self.finished_on_workers, self.preempted_on_workers = set(), set()
        order = cached.req_ids + [new.req_id for new in new_reqs]  # the order the workers pack them in
        return SchedulerOutput(new_reqs, cached, {rid: live.num_scheduled_tokens[rid] for rid in order},
                               live.total_num_scheduled_tokens, drafts, finished, preempted)

    def _add_grammar_bitmask(self, live: _LiveSchedulerOutput, output: SchedulerOutput) -> None:
        """The masks of the requests with a grammar that sample this step (they reach their last token):
        one row per position that samples, so ``1 + len(drafts)`` rows for a request verifying drafts."""
        sampling = [r for r in live.scheduled_reqs if r.structured_output_request is not None
                    and r.num_computed_tokens + live.num_scheduled_tokens[r.request_id] >= r.num_tokens]
        if not sampling:
            return
        if self.vocab_size is None:
            raise ValueError("vocab_size: a scheduler of requests with structured output needs the model's vocab_size")
        drafts = [output.scheduled_spec_decode_tokens.get(r.request_id, []) for r in sampling]
        words = -(-self.vocab_size // 32)
        bitmask = torch.full((sum(1 + len(d) for d in drafts), words), -1, dtype=torch.int32)  # -1: all allowed
        row = 0
        for request, request_drafts in zip(sampling, drafts):
            fill_bitmask_with_drafts(request.structured_output_request, bitmask, row, request.output_token_ids,
                                     request_drafts)
            row += 1 + len(request_drafts)
        output.grammar_bitmask = bitmask
        output.structured_output_request_ids = [r.request_id for r in sampling]

    # ---- after the step ------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput | Mapping[str, list[int]]) -> list[EngineCoreOutput]:
        """Stage 4's update with the runner's answer (or, from a model-free driver, ``{request id: tokens}``):
        its logprobs put on the requests, rejected drafts rolled back. Returns the output of every request
        that gained tokens or finished, with those finished outside a step before them."""
        if not isinstance(runner_output, ModelRunnerOutput):
            runner_output = ModelRunnerOutput.from_sampled(runner_output)
        sampled, requests = runner_output.by_request(), self.requests
        for field in ("prompt_logprobs", "logprobs"):
            for request_id, entries in getattr(runner_output, field).items():
                if request_id in requests:  # else aborted while its step ran
                    getattr(requests[request_id], field).extend(entries)
        num_sent = {rid: requests[rid].num_output_tokens for rid in scheduler_output.num_scheduled_tokens
                    if rid in requests}
        rejected = {}
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            tokens = sampled.get(rid)
            if tokens:  # none: aborted while its step ran
                rejected[rid] = len(drafts) + 1 - len(tokens)
                counters = self.counters
                counters.spec_decoding = counters.spec_decoding.observe(len(drafts), len(tokens) - 1)
        updated = super().update_from_output(scheduler_output, sampled)
        for rid, num_rejected in rejected.items():
            request = requests.get(rid)  # gone if it finished
            if request is not None and num_rejected > 0:
                request.num_computed_tokens -= num_rejected
        outputs, self.finished_outputs = self.finished_outputs, []
        for request in updated:
            del request.logprobs[request.num_output_tokens:]  # a stop inside a list of tokens drops those after it
            outputs.append(EngineCoreOutput.from_request(request, num_sent[request.request_id]))
        return outputs

    def step_failed(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The step that carried ``scheduler_output`` raised: its requests are aborted (their KV freed), and
        the workers are told again what the failed step would have told them. Returns the aborted ids."""
        self.finished_on_workers |= scheduler_output.finished_req_ids
        self.preempted_on_workers |= scheduler_output.preempted_req_ids
        failed = [rid for rid in scheduler_output.num_scheduled_tokens if rid in self.requests]
        self.recover_from_failed_step(scheduler_output)
        if self.kv_connector is not None:
            self.kv_connector.step_failed(scheduler_output.kv_connector_metadata)
        return failed

    def reset_prefix_cache(self) -> bool:
        reset = super().reset_prefix_cache()
        if reset and self.kv_connector is not None:
            self.kv_connector.reset_cache()
        return reset

    def stats(self) -> SchedulerStats:
        stats = super().stats()
        if self.kv_connector is not None:
            stats.kv_connector = replace(self.kv_connector.stats())
        return stats

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
