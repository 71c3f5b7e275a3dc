"""The real schedulers of stages 3, 4 and 5 under random operation sequences, with a fake model runner.

A ``RuleBasedStateMachine`` adds requests (random prompts, output limits, priorities, salts),
runs steps, aborts requests (while waiting, while running, and while their step executes),
fails whole steps and resets the prefix cache, on pools of a handful of blocks so that
preemption is constant. The "model" is a pure function of the tokens so far, so every
request has one right answer computed here without the scheduler; a test-side record of
what each physical block holds catches a prefix hit that serves the wrong KV.

After every step: the token budget and the caps hold, every request is in exactly one
queue, block tables cover exactly the computed tokens, reference counts equal holders, the
free queue plus held blocks is the pool, and the hash map is consistent. At the end the
machine drains: every request finished or was aborted, finished outputs equal the
reference exactly (preemption is invisible), aborted ones are a prefix of it, and the pool
is whole again.

Stage 5's scheduler runs the same machine with speculative steps: after each step every request
that goes on is given drafts (its true continuation, with some tokens deliberately wrong), the
fake runner verifies them as the real one does (keep while the model's token equals the draft),
and the rejected positions are rolled back. The same invariants hold, and a prefix hit must
never serve a block last written by a rejected draft.
"""

from __future__ import annotations

import math
import random

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shared import Request, RequestStatus, SamplingParams
from stage3_continuous.config import CacheConfig as PagedCacheConfig
from stage3_continuous.config import SchedulerConfig
from stage3_continuous.scheduler import Scheduler as ContinuousScheduler
from stage4_prefix_cache.scheduler import CacheConfig
from stage4_prefix_cache.scheduler import Scheduler as PrefixCacheScheduler
from stage5_server.core.request import Request as EngineRequest
from stage5_server.core.scheduler import Scheduler as SpeculativeScheduler
from tests.reliability.figures import count
from tests.reliability.settings import machine_settings

VOCAB = 12
EOS = 11
STEMS = [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 1, 1], [3, 2, 1, 0], []]  # shared stems: prefix hits
prompts = st.builds(lambda stem, tail: stem + tail, st.sampled_from(STEMS),
                    st.lists(st.integers(0, 3), max_size=5)).filter(len)


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of every token so far."""
    return sum((i + 1) * (t + 1) for i, t in enumerate(tokens)) * 7 % VOCAB


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    """What the request must produce, computed without a scheduler (same stop rules, written out)."""
    params, tokens, out = request.sampling_params, list(request.prompt_token_ids), []
    limit = max_model_len - len(tokens)
    if params.max_tokens is not None:
        limit = min(limit, params.max_tokens)
    while True:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
            return out, RequestStatus.FINISHED_STOPPED
        if len(out) >= limit:
            return out, RequestStatus.FINISHED_LENGTH_CAPPED


class SchedulerMachine(RuleBasedStateMachine):
    scheduler_class = ContinuousScheduler
    request_class = Request
    section = "scheduler_stage3"

    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(4, 10), budget=st.integers(1, 12),
                max_num_seqs=st.integers(1, 4), active_cap=st.integers(0, 4), chunked=st.booleans(),
                policy=st.sampled_from(["fcfs", "priority"]))
    def setup(self, block_size, num_blocks, budget, max_num_seqs, active_cap, chunked, policy):
        # What the engine guarantees (stage3_continuous/llm.py): the pool holds one max_model_len sequence,
        # and without chunked prefill the budget holds a whole prompt.
        self.max_model_len = num_blocks * block_size
        if not chunked:
            budget = max(budget, self.max_model_len)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      max_num_active_seqs=min(active_cap, max_num_seqs) or None,
                                      enable_chunked_prefill=chunked, policy=policy)
        self.scheduler = self.scheduler_class(self.config, self.make_cache_config(block_size, num_blocks),
                                              self.max_model_len)
        self.kv = self.scheduler.kv_cache_manager
        self.all_requests: dict[str, Request] = {}
        self.content: dict[int, tuple] = {}  # block id -> (salt, tokens up to its last written slot)
        self.next_id = 0
        self.clock = 0.0
        count(self.section, "runs")

    def make_cache_config(self, block_size, num_blocks):
        return PagedCacheConfig(block_size, num_blocks)

    def _live(self, output) -> tuple[list[Request], list[Request], dict[str, list[int]]]:
        """The scheduled requests (in packing order), those of them admitted this step, and their block tables,
        read from a step's output just after it was scheduled."""
        return output.scheduled_reqs, output.scheduled_new_reqs, output.block_tables

    # -- the fake model runner ---------------------------------------------------------------
    def _execute(self, output) -> dict[str, list[int]]:
        """Write each scheduled position into its block, then sample for requests at their last token."""
        sampled = {}
        scheduled, _, tables = self._live(output)
        for request in scheduled:
            n = output.num_scheduled_tokens[request.request_id]
            table = tables[request.request_id]
            start = request.num_computed_tokens
            for pos in range(start, start + n):
                self.content[table[pos // self.block_size]] = (request.cache_salt,
                                                               tuple(request.all_token_ids[:pos + 1]))
            end = start + n
            sampled[request.request_id] = [next_token(request.all_token_ids)] if end == request.num_tokens else []
        self._check_prefix_hits(output)
        return sampled

    def _schedule(self):
        output = self.scheduler.schedule()
        self._check_schedule(output)
        count(self.section, "steps")
        count(self.section, "preemptions", len(output.preempted_req_ids))
        return output

    def _check_schedule(self, output) -> None:
        config, sched = self.config, self.scheduler
        scheduled = output.num_scheduled_tokens
        assert output.total_num_scheduled_tokens == sum(scheduled.values()) <= config.max_num_batched_tokens
        assert len(scheduled) <= config.max_num_seqs
        assert len(sched.running) <= config.running_cap
        requests, new, tables = self._live(output)
        assert {r.request_id for r in requests} == set(scheduled)
        if output.preempted_req_ids:
            assert not new, "a step that preempted also admitted"
            assert output.preempted_req_ids.isdisjoint(scheduled)
        for request in requests:
            n = scheduled[request.request_id]
            assert 1 <= n <= request.num_tokens - request.num_computed_tokens
            if request in new and not config.enable_chunked_prefill:
                assert n == request.num_tokens - request.num_computed_tokens, "a prompt was chunked"
            table = tables[request.request_id]
            assert len(table) == math.ceil((request.num_computed_tokens + n) / self.block_size)
            assert request.status == RequestStatus.RUNNING

    def _check_prefix_hits(self, output) -> None:
        """After the step's writes (a hit may be on a block another request fills in the same step)."""
        _, new, tables = self._live(output)
        for request in new:  # a prefix hit must serve exactly this request's prefix
            table = tables[request.request_id]
            for i in range(request.num_computed_tokens // self.block_size):
                prefix = tuple(request.all_token_ids[:(i + 1) * self.block_size])
                assert self.content.get(table[i]) == (request.cache_salt, prefix), "a hit served the wrong KV"
            if request.num_computed_tokens:
                count(self.section, "prefix_hit_tokens", request.num_computed_tokens)

    # -- rules ---------------------------------------------------------------------------------
    @rule(prompt=prompts, max_tokens=st.one_of(st.none(), st.integers(1, 24)), ignore_eos=st.booleans(),
          stop=st.sampled_from([(), (4,)]), priority=st.integers(0, 2), salt=st.sampled_from([None, "A", "B"]))
    def add_request(self, prompt, max_tokens, ignore_eos, stop, priority, salt):
        self._add(prompt, max_tokens, ignore_eos, stop, priority, salt)

    @precondition(lambda self: self.all_requests)
    @rule(data=st.data(), max_tokens=st.integers(1, 8))
    def add_an_earlier_prompt_again(self, data, max_tokens):
        """The same prompt and salt as an earlier request: where prefix hits come from."""
        earlier = self.all_requests[data.draw(st.sampled_from(sorted(self.all_requests)))]
        self._add(earlier.prompt_token_ids, max_tokens, True, (), 0, earlier.cache_salt)

    def _add(self, prompt, max_tokens, ignore_eos, stop, priority, salt):
        self.clock += 1
        rid = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop))
        request = self.request_class(rid, prompt, params, arrival_time=self.clock, priority=priority,
                                     cache_salt=salt, eos_token_ids=(EOS,))
        fits = math.ceil(min(len(prompt) + 1, self.max_model_len) / self.block_size) <= self.num_blocks
        if len(prompt) >= self.max_model_len or not fits:
            return  # the engine's front end refuses these before the scheduler sees them
        self.scheduler.add_request(request)
        self.all_requests[rid] = request
        count(self.section, "requests")

    @rule(repeat=st.integers(1, 8))
    def step(self, repeat=1):
        for _ in range(repeat):
            output = self._schedule()
            self.scheduler.update_from_output(output, self._execute(output))

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data(), roll=st.integers(0, 2))
    def abort(self, data, roll):
        if roll != 1:
            return
        rid = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        assert self.all_requests[rid].status == RequestStatus.FINISHED_ABORTED
        count(self.section, "aborts")

    @rule(data=st.data(), roll=st.integers(0, 2))
    def abort_while_the_step_runs(self, data, roll):
        """The forward pass has run; the abort lands before its results are applied."""
        output = self._schedule()
        sampled = self._execute(output)
        if output.num_scheduled_tokens and roll == 1:
            rid = data.draw(st.sampled_from(sorted(output.num_scheduled_tokens)))
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            count(self.section, "aborts")
        self.scheduler.update_from_output(output, sampled)

    @rule(roll=st.integers(0, 4))
    def failed_step(self, roll):
        if roll != 3:  # rarely: a failure aborts every scheduled request
            return
        output = self._schedule()
        self.scheduler.recover_from_failed_step(output)  # nothing was written
        for rid in output.num_scheduled_tokens:
            assert self.all_requests[rid].status == RequestStatus.FINISHED_ABORTED
        count(self.section, "failed_steps")

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def every_request_is_in_exactly_one_place(self):
        sched = self.scheduler
        waiting = [r.request_id for r in sched.waiting]
        running = [r.request_id for r in sched.running]
        assert len(set(waiting)) == len(waiting) and len(set(running)) == len(running)
        assert set(waiting).isdisjoint(running)
        assert set(waiting) | set(running) == set(sched.requests)
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0 and not self.kv.get_block_ids(request.request_id)
        for rid, request in self.all_requests.items():
            assert request.is_finished == (rid not in sched.requests)
        stats = sched.stats()
        assert (stats.num_running, stats.num_waiting) == (len(running), len(waiting))

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self):
        for request in self.scheduler.running:
            assert len(self.kv.get_block_ids(request.request_id)) == math.ceil(
                request.num_computed_tokens / self.block_size)

    @invariant()
    def outputs_so_far_agree_with_the_reference(self):
        for request in self.all_requests.values():
            expected, _ = reference_output(request, self.max_model_len)
            assert request.output_token_ids == expected[:request.num_output_tokens]

    @invariant()
    def free_and_held_blocks_partition_the_pool(self):
        allocator = self.kv.allocator
        held = [b for rid in self.kv.tables for b in self.kv.tables[rid].block_ids]
        free = list(allocator._free)
        assert len(held) == len(set(held)), "a block is in two tables"
        assert sorted(free + held) == list(range(self.num_blocks))
        assert set(self.kv.tables) <= {r.request_id for r in self.scheduler.running}

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for _ in range(10_000):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        assert not self.scheduler.has_unfinished_requests(), "requests never finished"
        for request in self.all_requests.values():
            expected, status = reference_output(request, self.max_model_len)
            if request.status == RequestStatus.FINISHED_ABORTED:
                assert request.output_token_ids == expected[:request.num_output_tokens]
            else:
                assert (request.output_token_ids, request.status) == (expected, status), request
                count(self.section, "requests_finished")
        self.free_and_held_blocks_partition_the_pool()
        assert self.kv.usage == 0


class PrefixCacheSchedulerMachine(SchedulerMachine):
    scheduler_class = PrefixCacheScheduler
    section = "scheduler_stage4"

    def make_cache_config(self, block_size, num_blocks):
        return CacheConfig(block_size, num_blocks, enable_prefix_caching=True, prefix_caching_hash_algo="fast")

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll != 7:
            return
        done = self.scheduler.reset_prefix_cache()
        assert done == (self.kv.usage == 0)
        if done:
            assert not self.kv.block_pool.cached_block_hash_to_block

    @invariant()
    def free_and_held_blocks_partition_the_pool(self):
        pool = self.kv.block_pool
        holders: dict[int, int] = {}
        for blocks in self.kv.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), "ref_cnt != number of holders"
            if block.ref_cnt > 1:
                assert block.block_hash is not None, "an unhashed block is shared"
        free = [b.block_id for b in pool.free_block_queue]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        assert sorted(free + [b for b in holders]) == list(range(self.num_blocks))
        assert set(self.kv.req_to_blocks) <= {r.request_id for r in self.scheduler.running}
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_block_hash_to_block)


class SpeculativeSchedulerMachine(PrefixCacheSchedulerMachine):
    """Stage 5's scheduler: each decode also verifies up to ``k`` drafts inside the same budget."""

    scheduler_class = SpeculativeScheduler
    request_class = EngineRequest
    section = "scheduler_stage5_spec"

    def _live(self, output):
        """Stage 5's output is the workers' plain data: the live requests are the scheduler's own."""
        requests = [self.scheduler.requests[rid] for rid in output.num_scheduled_tokens]
        new = [self.scheduler.requests[data.req_id] for data in output.scheduled_new_reqs]
        return requests, new, {r.request_id: self.kv.get_block_ids(r.request_id) for r in requests}

    @initialize(k=st.integers(1, 4), seed=st.integers(0, 2**16))
    def setup_drafts(self, k, seed):
        self.k, self.rng = k, random.Random(seed)

    def _execute(self, output) -> dict[str, list[int]]:
        """Write every scheduled position, drafts included, then keep each draft while the model agrees."""
        sampled = {}
        scheduled, _, tables = self._live(output)
        for request in scheduled:
            drafts = output.scheduled_spec_decode_tokens.get(request.request_id, [])
            n = output.num_scheduled_tokens[request.request_id]
            table = tables[request.request_id]
            tokens = request.all_token_ids + drafts
            start = request.num_computed_tokens
            for pos in range(start, start + n):
                self.content[table[pos // self.block_size]] = (request.cache_salt, tuple(tokens[:pos + 1]))
            if start + n < request.num_tokens:
                sampled[request.request_id] = []  # mid-prefill
                continue
            known, gained = list(request.all_token_ids), []
            for draft in [*drafts, None]:
                gained.append(next_token(known))
                if gained[-1] != draft:
                    break
                known.append(draft)
            count(self.section, "drafts_accepted", len(gained) - 1)
            sampled[request.request_id] = gained
        self._check_prefix_hits(output)
        return sampled

    def _propose(self) -> None:
        """The true continuation of each running request, one draft in three wrong."""
        for request in self.scheduler.running:
            known, drafts = list(request.all_token_ids), []
            for _ in range(self.rng.randint(0, self.k)):
                token = next_token(known)
                if self.rng.random() < 1 / 3:
                    token = (token + 1) % VOCAB
                drafts.append(token)
                known.append(token)
            self.scheduler.add_draft_tokens(request, drafts)
            count(self.section, "drafts_proposed", len(request.spec_token_ids))

    def _check_schedule(self, output) -> None:
        drafts = output.scheduled_spec_decode_tokens
        requests, _, tables = self._live(output)
        for request in requests:
            n, num_drafts = output.num_scheduled_tokens[request.request_id], len(drafts.get(request.request_id, []))
            if num_drafts:  # a decode: its last token and its drafts, each with a slot
                assert request.num_tokens - request.num_computed_tokens == 1 and n == 1 + num_drafts <= 1 + self.k
                table = tables[request.request_id]
                assert len(table) >= math.ceil((request.num_computed_tokens + n) / self.block_size)
        plain = {rid: n - len(drafts.get(rid, [])) for rid, n in output.num_scheduled_tokens.items()}
        assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
        assert output.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert all(n >= 1 for n in plain.values())

    @rule(repeat=st.integers(1, 8))
    def step(self, repeat=1):
        for _ in range(repeat):
            output = self._schedule()
            self.scheduler.update_from_output(output, self._execute(output))
            self._propose()

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self):
        """The computed tokens, plus at most the slots of the drafts just rejected: they stay with their
        request and are written over by its next step, as in vLLM."""
        for request in self.scheduler.running:
            held = len(self.kv.get_block_ids(request.request_id))
            assert math.ceil(request.num_computed_tokens / self.block_size) <= held
            assert held <= math.ceil((request.num_computed_tokens + 1 + self.k) / self.block_size)


TestContinuousScheduler = SchedulerMachine.TestCase
TestContinuousScheduler.settings = machine_settings(max_examples=150, steps=40)
TestPrefixCacheScheduler = PrefixCacheSchedulerMachine.TestCase
TestPrefixCacheScheduler.settings = machine_settings(max_examples=150, steps=40)
TestSpeculativeScheduler = SpeculativeSchedulerMachine.TestCase
TestSpeculativeScheduler.settings = machine_settings(max_examples=150, steps=40)
