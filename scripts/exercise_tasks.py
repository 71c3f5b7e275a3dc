"""The exercises: the tasks of each stage, with their contracts, hints and the tests that judge them.

``scripts/make_exercises.py`` reads this table to write a learner's copy (each listed function
keeps its signature, its docstring gains the task's contract below, its body becomes
``raise NotImplementedError``), to check a copy task by task, and to render the Exercises
section of each stage page (``docs/snippets/exercises_stageN.md``).

A task is one function or several that only make sense together (stage 3's step: schedule,
execute, update). Its ``spec`` is the contract, not the algorithm: what the function is given,
what it returns or changes, and what must stay true, which is what the tests pin. The three
hints go from the idea, to the API that expresses it, to nearly the answer; the answer itself
is only ever shown by ``make peek``. tiny-llm's book does the same with its tasks
(``book/src/week3-01-continuous-batching.md``: each task names its files and its shapes, and
the reference sits apart, in ``src/tiny_llm_ref``).

Tasks of a stage are done in order: a task's tests use only the functions of the tasks before
it (and code that is never blanked), so with tasks 1..k-1 solved, tasks 1..k-1 pass and task k
fails on its own blank. ``tests/test_exercises.py`` holds every stage to exactly that, from a
blank copy to a fully solved one.

``tests`` are pytest node ids, relative to the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    name: str  # what the learner types: make check STAGE=N TASK=name
    file: str  # the file that holds the functions, relative to the repository root
    functions: tuple[str, ...]  # what the learner writes: "function" or "Class.method", all in ``file``
    minutes: int  # about how long the task takes a learner who has read the stage's page
    spec: str  # the contract the tests pin; goes into each blanked function's docstring
    hints: tuple[str, str, str]  # the idea, the API, nearly the answer: make hint TASK=name HINT=1..3
    tests: tuple[str, ...]  # pytest node ids that judge this task and nothing else


S1 = "tests/stage1/test_contiguous_kv_cache.py::"
S2 = "tests/stage2/test_paged_kv.py::"
S3 = "tests/stage3/test_scheduler.py::"
S4_CORE = "tests/stage4/test_prefix_cache_core.py::"
S4_POOL = "tests/stage4/test_block_pool.py::"
S4_SCHED = "tests/stage4/test_prefix_cache_scheduling.py::"
CORRECT = "tests/invariants/test_correctness.py::"
ROBUST = "tests/invariants/test_robustness.py::"
PAGED = "tests/invariants/test_paged_invariants.py::"
SCHED_INV = "tests/invariants/test_scheduling_invariants.py::"
STRUCTURED = "tests/invariants/test_structured_output_invariants.py::"


TASKS: dict[int, list[Task]] = {
    1: [
        Task(
            name="reserve",
            file="stage1_naive/kv_cache.py",
            functions=("ContiguousKVCache.reserve",),
            minutes=15,
            spec="""
Carve ``num_slots`` contiguous slots out of the slab for ``request_id``.

In: a request id and a size. The free space is ``self.free_extents``, a list of ``Extent(start,
length)`` sorted by start, no two touching.

Out: the first slot of the new reservation, or None when no single free extent is long enough.

Holds afterwards:

- the reservation is the *first* free extent (lowest start) that is long enough: first fit;
- ``self.reservations[request_id]`` is its ``Extent`` and ``self.written[request_id]`` is 0
  (``reserved_slots``, ``used_slots`` and the fragmentation counts read these two dicts);
- ``free_extents`` is still sorted, still without touching neighbours, and lost exactly the
  reserved slots (an extent used up exactly disappears);
- a refusal (None) changes nothing;
- a ``request_id`` that already holds a reservation is a ``ValueError`` whose message starts
  with ``request_id:``.
""",
            hints=(
                "Walk the free extents from the lowest start and stop at the first one that is long enough: "
                "the reservation takes that extent's front, and what is left of the extent stays free.",
                "`enumerate(self.free_extents)` gives the index you need to replace or delete the extent in "
                "place; `Extent` is a small dataclass, so make a new one rather than changing it.",
                "Taking `k` slots from `Extent(s, n)` leaves `Extent(s + k, n - k)` (or nothing when `n == k`); "
                "the reservation is `Extent(s, k)` and the method returns `s`.",
            ),
            tests=(
                S1 + "test_reserve_takes_the_first_hole_that_fits_and_a_refusal_changes_nothing",
                S1 + "test_internal_fragmentation_is_reserved_minus_written",
                S1 + "test_double_reservation_is_rejected",
            ),
        ),
        Task(
            name="release",
            file="stage1_naive/kv_cache.py",
            functions=("ContiguousKVCache.release",),
            minutes=15,
            spec="""
Give ``request_id``'s reservation back to the free space.

In: the id of a request that holds a reservation.

Holds afterwards:

- the request is in neither ``self.reservations`` nor ``self.written``;
- its slots are free again, and ``self.free_extents`` is sorted by start with no two extents
  touching: a hole that now borders a free extent on either side (or both) becomes one extent
  with it, so a later ``reserve`` can use the whole merged hole;
- no other reservation moves.
""",
            hints=(
                "Freeing can create neighbours: the released extent may touch the free extent before it, "
                "the one after it, or both. After adding it back, merge every pair that touches.",
                "`list.sort(key=lambda e: e.start)` restores the order; two extents touch when "
                "`a.start + a.length == b.start`.",
                "Append the extent, sort, then build a new list in one pass: extend the last kept extent when "
                "the next one touches it, else keep the next one as it is.",
            ),
            tests=(
                S1 + "test_reservations_are_first_fit_and_merge_on_release",
                S1 + "test_release_merges_a_hole_with_free_neighbours_on_both_sides",
            ),
        ),
        Task(
            name="external_fragmentation",
            file="stage1_naive/kv_cache.py",
            functions=("ContiguousKVCache.external_fragmentation",),
            minutes=5,
            spec="""
Free slots that a reservation of ``request_slots`` cannot use.

In: the size of the reservation someone wants. Out: an int, the free slots lying in holes too
small for it. A hole of exactly ``request_slots`` is usable and does not count; with no free
space, or with every hole large enough, it is 0.
""",
            hints=(
                "A free slot is wasted for this request when the hole it sits in is shorter than the request.",
                "Every hole is an `Extent` in `self.free_extents`, with a `length`.",
                "One `sum(...)` of the lengths, over the extents shorter than `request_slots`.",
            ),
            tests=(S1 + "test_external_fragmentation_counts_free_holes_too_small_for_a_reservation",),
        ),
        Task(
            name="static_batch",
            file="stage1_naive/engine.py",
            functions=("NaiveEngineCore._admit_batch", "NaiveEngineCore._end_batch_if_done"),
            minutes=25,
            spec="""
Static batching: a batch is formed only when the engine is empty, and it runs until its last
member finishes. Two methods of ``NaiveEngineCore`` make the policy; ``step()`` calls
``_admit_batch()`` when ``self.batch`` is empty, and ``_end_batch_if_done()`` after every step
and every abort.

``_admit_batch() -> list[Request]``

- fills ``self.batch`` from ``self.waiting`` in arrival order, up to ``self.max_num_seqs``
  requests, each only if ``self._reserve(request)`` finds it memory; the first request that
  does not fit ends the admission (nobody behind it jumps the queue);
- a waiting request whose grammar is still compiling (``request.waiting_for_grammar``) is
  passed over without ending the admission; one whose grammar failed
  (``request.grammar_failed``) is taken out of the queue and finished as
  ``RequestStatus.FINISHED_ABORTED`` (``self._finish``), and returned: the list of such refused
  requests is the return value;
- an admitted request leaves ``self.waiting``, is ``RequestStatus.RUNNING`` and records
  ``request.timeline.first_scheduled`` (its queue time ends there).

``_end_batch_if_done() -> None``

- while any member of ``self.batch`` is unfinished, nothing happens: finished members keep their
  reservations;
- once every member is finished, each member's memory is released (``self._release``) and
  ``self.batch`` is empty, so the next ``step()`` admits the next batch.

The tests run the real engine: reservations held until the slowest member ends, the same tokens
as transformers, no KV left reserved after a run or after aborts, and requests under a grammar.
""",
            hints=(
                "Admission is a loop over the waiting queue that stops at the first request that does not fit, "
                "and the batch ends as a whole: one check of 'all finished?' decides when everything is released.",
                "`self._reserve(request)` answers True or False (stage 2 swaps it for blocks); "
                "`next((r for r in self.waiting if not r.waiting_for_grammar), None)` is the next admissible "
                "request; `all(r.is_finished for r in self.batch)` is the end of the batch.",
                "`while len(self.batch) < self.max_num_seqs:` take that next request; break if it is None or "
                "(its grammar did not fail and) `_reserve` refuses; remove it from `waiting`; a failed grammar "
                "goes to `_finish(request, FINISHED_ABORTED)` and the returned list, anything else becomes "
                "RUNNING, gets `timeline.first_scheduled = now` and joins `self.batch`.",
            ),
            tests=(
                S1 + "test_static_batch_holds_reservations_until_its_slowest_member_ends",
                CORRECT + "test_greedy_matches_transformers_generate_on_ragged_batch[stage1_naive-llama]",
                ROBUST + "test_all_kv_returns_to_the_pool_after_requests_finish[stage1_naive]",
                ROBUST + "test_aborted_requests_free_their_kv[stage1_naive]",
                STRUCTURED + "test_greedy_output_under_a_grammar_is_valid_and_the_same_in_every_stage[stage1_naive]",
            ),
        ),
    ],
    2: [
        Task(
            name="blocks_needed",
            file="stage2_paged/block_table.py",
            functions=("BlockTable.blocks_needed",),
            minutes=5,
            spec="""
How many more blocks this table needs so that ``num_tokens`` tokens have slots.

In: a token count. The table holds ``len(self.block_ids)`` blocks of ``self.block_size`` slots.

Out: a non-negative int: the blocks missing for ``num_tokens`` tokens, and 0 when the table
already covers them (a table never gives blocks back here). ``grow`` allocates exactly this
many, so a table grows only when its last block is full.
""",
            hints=(
                "`num_tokens` tokens occupy a whole number of blocks, the last one possibly partly full.",
                "Integer ceiling without floats: `-(-a // b)`; clamp with `max(0, ...)`.",
                "`max(0, ceil(num_tokens / block_size) - len(self.block_ids))`, the ceiling written with `//`.",
            ),
            tests=(
                S2 + "test_blocks_needed_counts_only_the_blocks_the_table_lacks",
                S2 + "test_block_table_grows_only_when_a_block_fills",
            ),
        ),
        Task(
            name="slot_mapping",
            file="stage2_paged/block_table.py",
            functions=("slot_mapping",),
            minutes=10,
            spec="""
The flat KV-cache slots of positions ``start .. end - 1`` of a sequence whose blocks are ``block_ids``.

In: the sequence's physical block ids in logical order (any order in memory, not adjacent), the
block size, and a half-open range of positions.

Out: one slot per position, in order (empty when ``start == end``). A slot is an index into the
cache viewed as ``[num_blocks * block_size]`` rows: the row of that position inside the physical
block the table names for it. Every later stage (stage 3's engine, tensor parallelism) addresses
K/V through this one function.
""",
            hints=(
                "A position has a logical block (which block of the sequence) and an offset inside it; the table "
                "turns the logical block into a physical one.",
                "`p // block_size` and `p % block_size`; physical block `b` starts at slot `b * block_size`.",
                "`[block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]`.",
            ),
            tests=(
                S2 + "test_seed_example_a_to_h_occupies_two_blocks_that_need_not_be_adjacent",
                S2 + "test_slot_mapping_follows_the_table_across_scattered_blocks",
            ),
        ),
        Task(
            name="gather_kv",
            file="stage2_paged/attention.py",
            functions=("gather_kv",),
            minutes=15,
            spec="""
One sequence's first ``seq_len`` K (or V) rows, read through its block table.

In: ``cache [num_blocks, block_size, num_kv_heads, head_dim]``; ``block_table``, a 1-D integer
tensor of physical block ids in logical order, possibly padded past the sequence's last block;
``seq_len``.

Out: ``[seq_len, num_kv_heads, head_dim]``, row ``p`` the K/V of position ``p``. Padding
entries of the table and slots past ``seq_len`` are never part of the result. ``paged_attention``
gathers every sequence with more than one query row this way, so the paged result must equal
dense attention over the gathered keys, for block sizes 1, 4 and 16 and GQA groups 1, 2 and 4.
""",
            hints=(
                "Read whole blocks, not single positions: the first `ceil(seq_len / block_size)` entries of the "
                "table name every block the sequence has written, in order.",
                "Indexing a tensor with a `long` tensor of ids gathers rows: `cache[ids]` is "
                "`[n, block_size, H, D]`; `.flatten(0, 1)` joins the first two dims.",
                "`cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]`.",
            ),
            tests=(
                S2 + "test_gather_kv_returns_positions_in_logical_order",
                S2 + "test_paged_attention_equals_dense_attention_on_gathered_keys",
            ),
        ),
        Task(
            name="paged_engine",
            file="stage2_paged/engine.py",
            functions=("PagedEngineCore._reserve", "PagedEngineCore._attention_metadata",
                       "PagedEngineCore._on_finished"),
            minutes=35,
            spec="""
Stage 1's static-batching loop on blocks: the three methods stage 2 swaps into
``NaiveEngineCore`` to change the memory layout and keep the loop.

``_reserve(request) -> bool``: admission. True only if the blocks the request can ever need (its
prompt plus its maximum output, ``request.max_output_tokens(self.max_model_len)``, in whole
blocks) fit in the free blocks not already promised to running requests. Admitting gives the
request an empty ``BlockTable`` in ``self.block_tables`` and records its promise in
``self.promised`` (blocks it may still take). Refusing changes nothing.

``_attention_metadata(scheduled, inputs) -> PagedAttentionMetadata``: for one step.
``scheduled`` is ``[(request, num_new_tokens)]``; a request's new tokens are positions
``num_computed_tokens .. num_computed_tokens + num_new - 1``. Every table grows by exactly the
blocks those positions need (taken from ``self.allocator``, subtracted from its promise), and the
metadata carries each new token's slot (in ``scheduled`` order), each sequence's block ids, and
``inputs``' ``query_start_loc`` and ``seq_lens`` (``build_paged_metadata`` packs lists into tensors).

``_on_finished(request) -> None``: a finished request's blocks go back to the allocator at once
(unlike stage 1's slab), and its table and promise are forgotten; calling it for a request that
holds nothing is harmless (``_release`` calls it again at the batch's end).

Holds: no block is ever in two live tables; the pool is whole again after every run or abort;
the tokens are transformers' whatever the blocks' physical order.
""",
            hints=(
                "Promise at admission, allocate lazily: a request is admitted against the free blocks minus "
                "what is promised to others, and takes its blocks one at a time as its sequence grows.",
                "`BlockTable.grow(num_tokens, allocator)` returns the block ids it added; "
                "`table.slot_mapping(start, end)` gives slots; `self.allocator.free(ids)` gives blocks back; "
                "`build_paged_metadata(slots, inputs.query_start_loc, inputs.seq_lens, tables, self.device)`.",
                "`need = ceil((num_prompt_tokens + max_output_tokens) / block_size)`, refused if "
                "`need > allocator.num_free - sum(self.promised.values())`; per scheduled request: "
                "`new = table.grow(start + num_new, allocator)`, `promised[id] -= len(new)`, extend the slots "
                "with `table.slot_mapping(start, start + num_new)`; `_on_finished` pops the table (default None) "
                "and frees its ids.",
            ),
            tests=(
                S2 + "test_stage2_admits_by_blocks_where_stage1_reserves_max_model_len",
                CORRECT + "test_greedy_matches_transformers_generate_on_ragged_batch[stage2_paged-llama]",
                PAGED + "test_outputs_do_not_depend_on_physical_block_order[stage2_paged]",
                PAGED + "test_live_block_tables_never_share_a_physical_block[stage2_paged]",
                ROBUST + "test_aborted_requests_free_their_kv[stage2_paged]",
            ),
        ),
    ],
    3: [
        Task(
            name="update_from_output",
            file="stage3_continuous/scheduler.py",
            functions=("Scheduler.update_from_output",),
            minutes=20,
            spec="""
After a forward pass: advance every request the step scheduled, append the tokens it sampled,
and finish what must stop.

In: the step's ``SchedulerOutput`` (``num_scheduled_tokens``: request id -> input positions the
step computed) and ``sampled_token_ids``: request id -> the tokens sampled for it, an empty
list (or no entry) for a request in the middle of a chunked prefill.

Out: the requests that were given at least one token, in ``num_scheduled_tokens`` order.

Holds afterwards:

- every scheduled request still known and unfinished has ``num_computed_tokens`` advanced by
  its scheduled count; a request aborted while its step ran (gone from ``self.requests``, or
  finished) is skipped entirely;
- each sampled token is appended with ``request.append_output_token(token, now)``, ``now`` one
  ``time.monotonic()`` for the whole step; a request that ``check_stop(request,
  self.max_model_len)`` says is finished takes no further token, leaves ``self.running`` and is
  freed with ``self._free`` (its blocks return to the pool, its id is reported in the next
  ``SchedulerOutput.finished_req_ids``);
- ``self.counters`` counts the step: ``num_prompt_tokens_computed`` grows by the scheduled
  positions that were still prompt, ``num_generation_tokens`` by the tokens appended, and
  ``observe_step`` is called once with the sum of both.

The tests build each step's ``SchedulerOutput`` by hand, so this task needs no ``schedule()``.
""",
            hints=(
                "A step computed positions and sampled tokens, two different counts: a prefill chunk computes "
                "many positions and samples nothing until the prompt's last position is in it.",
                "`shared.request.check_stop` sets the finished status (and `stop_reason`) itself and returns "
                "True; the part of `num_new` that was prompt is "
                "`min(num_new, request.num_prompt_tokens - request.num_computed_tokens)`, counted before you "
                "advance `num_computed_tokens`.",
                "Loop over `num_scheduled_tokens.items()`; skip unknown or finished requests; count the prompt "
                "part; advance; `for token in sampled_token_ids.get(rid) or []:` append, count, and on "
                "`check_stop` remove from `running`, `_free`, `break`; add the request to the result if it had "
                "tokens; after the loop add the counts to `self.counters` and call `observe_step(total)`.",
            ),
            tests=(
                S3 + "test_update_from_output_advances_a_prefill_chunk_and_appends_only_sampled_tokens",
                S3 + "test_update_from_output_finishes_a_stopped_request_and_frees_it",
                S3 + "test_update_from_output_skips_a_request_aborted_while_its_step_ran",
            ),
        ),
        Task(
            name="schedule",
            file="stage3_continuous/scheduler.py",
            functions=("Scheduler.schedule",),
            minutes=50,
            spec="""
Decide the next forward pass: which requests run, and how many input positions each computes.

In: the scheduler's state: ``self.running`` (admission order), ``self.waiting``, the config
(``max_num_batched_tokens``: the step's token budget; ``max_num_seqs``; ``running_cap``, from
``max_num_active_seqs``; ``enable_chunked_prefill``; ``policy``) and the KV cache manager.

Out: a ``SchedulerOutput``: ``scheduled_running_reqs`` and ``scheduled_new_reqs`` (admitted this
step, a resumed one included), ``num_scheduled_tokens`` (id -> positions),
``total_num_scheduled_tokens``, ``block_tables`` (``self._block_tables`` of every scheduled id),
``preempted_req_ids``, ``finished_req_ids`` (what finished since the last step; a new empty set
takes its place) and ``aborted_reqs``.

Holds, every step:

- the positions scheduled never exceed the budget, nor the requests ``max_num_seqs``;
- decode-first: every running request is offered its missing positions
  (``self._num_tokens_to_compute``: one for a decode, the rest of its prompt mid-prefill, cut to
  the budget left) before any waiting request is admitted;
- every scheduled position is backed by KV (``kv_cache_manager.allocate_slots`` returned blocks);
  when it cannot be, the running request with the largest ``(priority, arrival_time)`` among
  those not yet granted tokens this step (this one included) is preempted
  (``running.remove`` it, ``self._preempt`` it, record its id), and the allocation retried;
  nothing waiting is admitted in a step that preempted;
- waiting requests are admitted in policy order (``self._peek_waiting()``, None when only
  requests whose grammar is compiling wait) while there is budget, a free place under
  ``max_num_seqs`` and ``running_cap``; a request whose grammar failed is finished as aborted
  (``finish_requests``) and listed in ``aborted_reqs``; a prefix-cache hit
  (``get_computed_blocks``, none in stage 3) counts as computed; without chunked prefill a prompt
  that does not fit whole waits; a request the pool cannot back stays first in line; an
  admitted request moves to ``running``, is RUNNING, has ``num_computed_tokens`` and
  ``num_cached_tokens`` set to the hit, and keeps the ``timeline.first_scheduled`` of its first
  admission.

The tests pin the seed's budget-6 trace (R0 decodes one token every step; R1's nine-token
prompt goes in as 5 + 4), the caps, the priority order, a request mid-prefill keeping its
place, aborts, and preemption of the newest request when the pool runs out.
""",
            hints=(
                "Two phases share one budget: first the running requests in admission order, each asking for "
                "the positions it lacks; then, with what is left, the waiting ones. Memory can refuse a running "
                "request: then someone who has not been given tokens yet this step must make room.",
                "`allocate_slots(request, num_new)` returns None when the pool cannot back the positions; "
                "`allocate_slots(request, num_new, num_computed, computed_blocks)` for a waiting one after "
                "`get_computed_blocks(request)`; Python's `while ...: ... else:` runs the `else` only when the "
                "loop ended without `break`.",
                "Phase 1 with an index, since preemption removes from the list you walk: `while index < "
                "len(running) and budget > 0 and len(scheduled) < max_num_seqs:` compute `num_new`, then "
                "`while allocate_slots(...) is None:` pick `victim = max(running[index:], key=lambda r: "
                "(r.priority, r.arrival_time))`, remove and `_preempt` it, `break` if it was this request; "
                "`else:` record it, spend the budget, `index += 1`. Phase 2 is a `while` over "
                "`_peek_waiting()` with the conditions above.",
            ),
            tests=(
                S3 + "test_seed_trace_budget_six_r0_decoding_r1_nine_token_prompt",
                S3 + "test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole",
                S3 + "test_max_num_seqs_caps_requests_scheduled_per_step",
                S3 + "test_max_num_active_seqs_caps_the_running_set_despite_spare_budget",
                S3 + "test_priority_policy_runs_lower_values_first_ties_by_arrival",
                S3 + "test_update_from_output_finishes_on_eos_stop_token_and_max_tokens",
                S3 + "test_a_request_mid_prefill_gets_no_token_and_keeps_its_place",
                S3 + "test_abort_of_waiting_and_running_requests_frees_blocks_and_reports_them",
            ),
        ),
        Task(
            name="preempt",
            file="stage3_continuous/scheduler.py",
            functions=("Scheduler._preempt",),
            minutes=10,
            spec="""
Preempt ``request`` by recompute. The caller (``schedule``) has already taken it out of
``self.running``.

Holds afterwards:

- it holds no KV blocks, and ``num_computed_tokens`` is 0: when it runs again it re-prefills its
  prompt *and* the tokens it had generated, which it keeps;
- its status is ``RequestStatus.PREEMPTED``; ``request.num_preemptions`` and
  ``self.counters.num_preemptions`` (the stats line, ``vllm:num_preemptions``) are one higher;
- it is first in ``self.waiting``, ahead of requests that never ran.

The tests pin a four-block pool where the newest request is the one preempted, keeps its three
output tokens, waits first in line and re-prefills 6 + 3 = 9 tokens when room returns.
""",
            hints=(
                "Recompute means forgetting the KV, not the tokens: the request's text so far is its new prompt.",
                "`self.kv_cache_manager.free(request)` returns its blocks; `deque.appendleft` puts it in front.",
                "Free, set `num_computed_tokens = 0` and the status, add one to both counters, "
                "`self.waiting.appendleft(request)`; leave `self.running` alone.",
            ),
            tests=(
                S3 + "test_preemption_by_recompute_frees_the_newest_and_requeues_it_first_with_its_tokens",
            ),
        ),
        Task(
            name="engine_step",
            file="stage3_continuous/engine.py",
            functions=("EngineCore.step", "kv_layout"),
            minutes=25,
            spec="""
The whole step: schedule, run the model, update from its output. ``EngineCore.step`` drives it;
``kv_layout`` says where the step's K/V go.

``kv_layout(batch, block_tables, block_size) -> (slots, tables)``: ``batch`` is the step's
``[(request, num_new_tokens)]``, running requests first (``scheduled_batch(output)``);
``block_tables`` maps a request id to its physical block ids. ``slots`` has one cache slot per new
token, in batch order (a request's new tokens are positions ``num_computed_tokens ..
num_computed_tokens + num_new - 1``); ``tables`` is each request's block ids, in batch order.

``EngineCore.step() -> list[Request]``:

- asks ``self.scheduler.schedule()`` for the step; appends ``dict(num_scheduled_tokens)`` to
  ``self.step_trace`` when tracing is on (it is not None);
- a step with nothing scheduled runs no model and returns ``output.aborted_reqs``;
- otherwise ``self.execute_model(output)`` gives one sampled token per scheduled request (it
  calls ``kv_layout``); if it raises, ``self.scheduler.recover_from_failed_step(output)`` frees the
  step's requests before the error goes on to the caller;
- the tokens go to ``update_from_output`` as lists (``{id: [token]}``), the stats logger (if any)
  sees ``self.stats()``, and the return value is ``output.aborted_reqs`` then the updated requests.

The tests run the real engine: the budget and caps hold every step, requests join others that
are decoding, preemption leaves greedy outputs unchanged, and a failed step frees its KV.
""",
            hints=(
                "The engine core owns no policy: the scheduler decides, the runner computes, the scheduler "
                "learns the result. The only place positions meet memory is the slot of each new token.",
                "`stage2_paged.block_table.slot_mapping(table, block_size, start, end)` gives slots; "
                "`try: ... except Exception: ...; raise` re-raises after cleaning up.",
                "`kv_layout`: for each `(request, num_new)`, `start = request.num_computed_tokens`, extend the "
                "slots with `slot_mapping(table, block_size, start, start + num_new)` and append the table. "
                "`step`: schedule, trace, return early on 0 tokens, `sampled = self.execute_model(output)` under "
                "the try, then `self.scheduler.update_from_output(output, {rid: [t] for rid, t in "
                "sampled.items()})`.",
            ),
            tests=(
                SCHED_INV + "test_token_budget_and_sequence_caps_hold_every_step[stage3_continuous]",
                SCHED_INV + "test_requests_join_while_others_are_decoding[stage3_continuous]",
                SCHED_INV + "test_preemption_is_transparent_to_greedy_outputs[stage3_continuous]",
                ROBUST + "test_kv_returns_to_the_pool_when_a_step_fails[stage3_continuous]",
            ),
        ),
    ],
    4: [
        Task(
            name="hash_request_tokens",
            file="stage4_prefix_cache/kv_cache_utils.py",
            functions=("hash_request_tokens",),
            minutes=10,
            spec="""
The chained hashes of every *full* block of ``token_ids``, from the first block on.

In: a block size, the token ids, the extra keys (a salt, an adapter: ``(source, value)`` pairs)
and a hash function. Out: one hash per full block, in order.

Holds:

- a block's hash is ``hash_block_tokens(parent, block_tokens, extra_keys, hash_fn)``, its parent
  the previous block's hash (None for the first): equal tokens after different prefixes hash
  differently, and one changed token changes every later hash;
- extra keys change every hash;
- a trailing partial block is never hashed (its contents will still change);
- a ``block_size`` that is not a positive int is a ``ValueError`` naming ``block_size``.
""",
            hints=(
                "Each hash covers its block's tokens and, through its parent, every token before them: the "
                "chain is what makes a block's identity its whole prefix.",
                "`range(0, len(token_ids) - block_size + 1, block_size)` yields the start of every full block; "
                "`type(block_size) is not int` also catches `True` and `4.0`.",
                "Check `block_size`; then `parent = None`, and for each full block "
                "`parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys, hash_fn)`, "
                "appended to the result.",
            ),
            tests=(
                S4_CORE + "test_hash_is_the_parent_then_tokens_then_extra_keys",
                S4_CORE + "test_bad_hash_inputs_are_value_errors_naming_the_field",
                S4_POOL + "test_request_hashes_chain_full_blocks_and_skip_the_partial_one",
                S4_POOL + "test_extra_keys_change_every_block_hash_of_a_request",
            ),
        ),
        Task(
            name="ref_counts",
            file="stage4_prefix_cache/block_pool.py",
            functions=("BlockPool.touch", "BlockPool.free_blocks"),
            minutes=20,
            spec="""
The two sides of a block's reference count: ``touch`` adds a user to each block a prefix-cache
hit reuses, ``free_blocks`` drops one user from each block a request gives back.

The invariant both keep: a block is in ``self.free_block_queue`` exactly when its ``ref_cnt`` is
0, and a block in use can never be evicted. The queue's head is evicted first.

``touch(blocks)``: each block gains one user; a block that had none was waiting in the free
queue as an eviction candidate and is no longer in it. Its hash stays.

``free_blocks(ordered_blocks)``: each block, in the order given, loses one user; a block left
with none joins the free queue at once, one block at a time: a cached block (``block_hash``
set) at the *tail*, kept as long as possible in case someone shares it; an uncached one (a
partial block) at the *head*, reused first. A block that still has users stays out of the
queue. Hashes are untouched: a free, cached block still answers ``get_cached_block`` until an
allocation pops it. (``KVCacheManager.free`` passes a request's table in reverse, so a
sequence's tail leaves before its prefix.)
""",
            hints=(
                "The free queue is the LRU list of blocks nobody uses; a block leaves it when someone starts "
                "using it again and joins it when the last user lets go, at the end that matches how useful "
                "its contents are.",
                "`FreeKVCacheBlockQueue` has `remove(block)` (O(1), from anywhere), `append` (the tail) and "
                "`appendleft` (the head).",
                "`touch`: `if block.ref_cnt == 0: self.free_block_queue.remove(block)`, then `block.ref_cnt += 1`. "
                "`free_blocks`: `block.ref_cnt -= 1`; if it reached 0, `append` when `block.block_hash` is set, "
                "else `appendleft`.",
            ),
            tests=(
                S4_POOL + "test_freed_blocks_queue_one_by_one_cached_to_the_tail_uncached_to_the_head",
                S4_POOL + "test_a_freed_cached_block_keeps_its_hash_until_it_is_reused",
                S4_POOL + "test_touch_adds_a_user_to_a_block_in_use",
                S4_POOL + "test_touch_takes_a_free_cached_block_out_of_the_free_queue",
                S4_POOL + "test_a_touched_block_returns_to_the_queue_only_when_its_last_user_frees_it",
            ),
        ),
        Task(
            name="get_computed_blocks",
            file="stage4_prefix_cache/kv_cache_manager.py",
            functions=("KVCacheManager.get_computed_blocks",),
            minutes=20,
            spec="""
The prefix-cache lookup: the longest run of cached blocks that matches the request from its
first token.

In: a request that holds no blocks yet (new, or back from preemption).

Out: ``(blocks, num_computed_tokens)``: the pool's own block objects (not copies), in order, and
the tokens they cover.

Holds:

- only whole blocks hit, and only a run that starts at the first block: the first block missing
  from the cache ends it;
- the hit never covers the last token: at most ``num_tokens - 1`` tokens, rounded down to whole
  blocks, since the last position's logits give the next token (with block size 4, a prompt
  sharing ``A B C D E F`` with a cached one reuses 4; a fully cached 8-token prompt reuses 4;
  a 9-token prompt whose first 8 are cached reuses 8);
- the request's hashes include its cache salt (``self._get_block_hashes(request)``), so another
  salt shares nothing;
- ``self.prefix_cache_stats`` counts the lookup: ``requests`` +1, ``queries`` + the request's
  tokens, ``hits`` + ``num_computed_tokens``;
- with caching off, or for a request with ``skip_reading_prefix_cache`` set, the answer is
  ``([], 0)`` and nothing is counted;
- nothing is reserved: ``allocate_slots`` touches the hits right after.
""",
            hints=(
                "A block can be reused only if every block before it is reused too, and the prompt's last "
                "position must still run.",
                "`self.block_pool.get_cached_block(block_hash)` returns the block or None; "
                "`(request.num_tokens - 1) // self.block_size` is the most blocks that may hit.",
                "Return early when caching is off (or `getattr(request, 'skip_reading_prefix_cache', False)`); "
                "walk `self._get_block_hashes(request)[:max_hit_blocks]`, appending blocks until the first "
                "None; `num_computed = len(blocks) * self.block_size`; update the three counters; return both.",
            ),
            tests=(
                S4_CORE + "test_only_full_blocks_are_reused",
                S4_CORE + "test_chained_hash_distinguishes_identical_block_tokens_after_different_prefixes",
                S4_CORE + "test_cache_salt_changes_reuse_identity",
                S4_CORE + "test_hit_is_capped_at_prompt_minus_one_and_rounded_down_to_whole_blocks",
                S4_CORE + "test_prefix_cache_stats_count_queried_and_hit_tokens",
                S4_CORE + "test_caching_disabled_finds_nothing_counts_nothing_and_hashes_nothing",
                S4_CORE + "test_hit_increments_ref_counts_of_blocks_in_use",
                S4_CORE + "test_hit_takes_free_but_cached_blocks_out_of_the_free_queue",
                S4_CORE + "test_free_releases_in_reverse_table_order_cached_to_tail_uncached_to_head",
                S4_CORE + "test_seed_scenario_release_order_on_the_real_pool",
                S4_CORE + "test_seed_scenario_with_r2_reusing_the_freed_suffix_block",
                S4_CORE + "test_a_hit_block_is_never_the_one_evicted_for_the_same_requests_new_blocks",
                S4_SCHED + "test_seed_r1_enters_with_five_tokens_and_finishes_prefill_in_step_zero",
                S4_SCHED + "test_same_salt_shares_prefix_blocks_and_different_salts_share_nothing",
            ),
        ),
    ],
    5: [
        Task(
            name="reshape_and_cache",
            file="stage5_server/kernels/reshape_and_cache.py",
            functions=("_reshape_and_cache_kernel",),
            minutes=30,
            spec="""
The Triton kernel that writes this step's new K and V rows into their cache slots; the launcher
runs one program per token (``tl.program_id(0)``).

In (as pointers and strides): ``key`` and ``value`` ``[num_tokens, num_kv_heads, head_dim]``,
possibly non-contiguous views; ``key_cache`` and ``value_cache`` ``[num_blocks, BLOCK_SIZE,
num_kv_heads, head_dim]``; ``slot_mapping [num_tokens]``, each token's flat slot
(``block_id * BLOCK_SIZE + offset``), negative for a padding token. ``BLOCK_H`` and ``BLOCK_D``
are ``num_kv_heads`` and ``HEAD_DIM`` rounded up to powers of two.

Holds afterwards: for every token with a slot ``>= 0``, ``key_cache[slot // BLOCK_SIZE, slot %
BLOCK_SIZE]`` equals its key (cast to the cache's dtype), all heads and dims, and the same for
the value; a padding token writes nothing; no element outside a token's ``[num_kv_heads,
head_dim]`` row is touched (the tile's padding is masked). Every address goes through the given
strides. The test runs under ``TRITON_INTERPRET=1`` (no GPU needed) and compares every slot
exactly, for block sizes 8 and 16, fp32 and fp16.
""",
            hints=(
                "One program moves one token's whole `[heads, dims]` row in one load and one store per tensor; "
                "the slot says which block and which row of it.",
                "`tl.arange(0, BLOCK_H)` and `tl.arange(0, BLOCK_D)` broadcast into a tile of offsets "
                "(`heads[:, None] * stride_h + dims[None, :] * stride_d`); `tl.load(ptrs, mask=mask)` and "
                "`tl.store(ptrs, values, mask=mask)`; `key_cache_ptr.dtype.element_ty` is the cache's type.",
                "`slot = tl.load(slot_mapping_ptr + token).to(tl.int64)`, `if slot < 0: return`; "
                "`mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)`; load the key at "
                "`key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd` and "
                "store it at `key_cache_ptr + (slot // BLOCK_SIZE) * stride_kcb + (slot % BLOCK_SIZE) * "
                "stride_kcs + ...`, `.to(key_cache_ptr.dtype.element_ty)`; the same for the value.",
            ),
            tests=("tests/stage5/test_triton_kernels.py::"
                   "test_reshape_and_cache_writes_each_token_to_its_slot_and_skips_negative_slots",),
        ),
        Task(
            name="workers_view",
            file="stage5_server/core/scheduler.py",
            functions=("Scheduler._for_workers",),
            minutes=40,
            spec="""
The step as every worker receives it: plain data, each request whole the first time the workers
see it, and afterwards only what it gained since.

In: ``live``, stage 4's decision for the step (its ``SchedulerOutput``, with live ``Request``
objects); ``self.sent_to_workers`` (request id -> ``[tokens, blocks]`` the workers hold);
``self.finished_on_workers`` and ``self.preempted_on_workers`` (ids the workers must drop);
``self.kv_cache_manager.req_to_blocks`` (each request's blocks).

Out: ``SchedulerOutput(new, cached, num_scheduled_tokens, total, drafts, finished, preempted)``
from ``core/scheduler_output.py``:

- ``new``: a ``NewRequestData`` for each scheduled request the workers do not hold (its prompt
  and output tokens, sampling parameters, EOS and bad-words ids, block ids,
  ``num_computed_tokens``, ``len(request.prompt_logprobs)``, images and adapter); a finished or
  preempted request is not held any more (a preempted one comes back whole);
- ``cached``: one ``CachedRequestData`` with, for each scheduled request they hold, its id, the
  tokens after the ones they hold, the block ids after theirs, and its ``num_computed_tokens``;
- ``num_scheduled_tokens`` in the order the workers pack the rows: the cached requests, then the
  new ones; ``total`` is ``live.total_num_scheduled_tokens``;
- ``drafts``: id -> the draft tokens each scheduled running request verifies this step, its
  ``spec_token_ids`` cut to ``num_scheduled_tokens[id] - 1`` (the budget may have cut some), only
  where any are left; every such request's ``spec_token_ids`` is ``[]`` afterwards;
- ``finished`` and ``preempted``: the two sets, which are empty on the scheduler afterwards.

Holds: ``sent_to_workers`` says, after the call, exactly what the workers hold:
``[request.num_tokens, len(blocks)]`` for each scheduled request. The tests compare the
persistent input batch the workers build from these messages with the inputs stage 3 builds
from the live requests, step after step, through chunked prefill, preemption and aborts.
""",
            hints=(
                "The scheduler keeps a ledger of what each worker already holds, so a running request costs "
                "a message of its new tokens and new block ids, not its whole history.",
                "`request.all_token_ids[num_tokens:]` is what a request gained since the workers last saw it, "
                "`blocks[num_blocks:]` the blocks it gained; `live.scheduled_reqs` is the running ones, then "
                "the new ones; `NewRequestData(...)` takes its fields positionally in the order listed.",
                "Pop `finished | preempted` from the ledger; collect the drafts from "
                "`live.scheduled_running_reqs`; then for each of `live.scheduled_reqs` either append a "
                "`NewRequestData` and set the ledger to `[request.num_tokens, len(blocks)]`, or append to the "
                "four lists of `CachedRequestData` and update the ledger in place; keep the two sets, reset "
                "them, and order the counts `cached.req_ids + [n.req_id for n in new]`.",
            ),
            tests=(
                "tests/stage5/test_input_batch.py::"
                "test_inputs_match_the_list_built_ones_through_chunked_prefill_and_preemption",
                "tests/stage5/test_input_batch.py::test_an_aborted_request_id_taken_again_gets_a_fresh_row",
                "tests/stage5/test_input_batch.py::test_rows_of_requests_aborted_while_nothing_ran_are_taken_back",
            ),
        ),
        Task(
            name="api_keys",
            file="stage5_server/server/auth.py",
            functions=("APIKeys.authenticate", "APIKeyMiddleware.__call__"),
            minutes=30,
            spec="""
No valid key, no entry: ``APIKeys.authenticate`` says which trust group a key belongs to, and
``APIKeyMiddleware``, wrapped around the whole ASGI app, lets a request in only with one.

``APIKeys.authenticate(token) -> str | None``: the trust group of the API key ``token``, or
None for no key, an unknown key or a near miss (``"k1 "``). Keys in one group give that group; a
key configured without a group has one of its own (``key#3``). The time it takes says nothing
about which key matched, or how much of one: the token's SHA-256 digest is compared with every
configured digest (``self._digests``: pairs of digest and group), in constant time, without
stopping at a match.

``APIKeyMiddleware.__call__(scope, receive, send)``:

- scopes other than ``"http"`` and ``"websocket"`` (the lifespan) go straight to ``self.app``;
- every http or websocket scope gets ``scope[RECEIVED_SCOPE_KEY] = time.monotonic()`` (the
  request's timeline starts here);
- its group is ``PUBLIC_GROUP`` when the server has no keys (``self.keys is None``), else the
  group of its bearer token (``_bearer_token(scope)``);
- without a group, and on a route (``_route_path(scope)``) not in ``self.public_paths``, it is
  refused: a websocket with ``{"type": "websocket.close", "code": 1008}``, HTTP with a 401 whose
  body is ``error_body("Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
  "invalid_request_error", None, "invalid_api_key")`` and a ``www-authenticate: Bearer`` header
  (``send_json``);
- with one, ``scope[TRUST_GROUP_SCOPE_KEY] = group`` and the app runs.

Because it runs before routing, every route is covered, including ones added after
``create_app`` and paths that do not exist (401 without a key, 404 with one). The tests try every
route with no key, a wrong key and a Basic header; ``/health`` stays open, ``/metrics`` only when
the server makes it public.
""",
            hints=(
                "Authentication happens once, outside routing, and its only output is a trust group written "
                "into the request's scope; the comparison of secrets must not leak through its timing.",
                "`hashlib.sha256(token.encode()).digest()` and `hmac.compare_digest(a, b)`; an ASGI middleware "
                "is `async def __call__(self, scope, receive, send)` that answers through `send` or awaits "
                "`self.app(scope, receive, send)`; `send_json` and `error_body` are in `server/errors.py`.",
                "`authenticate`: None for None; loop over every `(digest, group)` pair and remember the group "
                "whose digest matches; return it after the loop. `__call__`: pass non-http scopes through, "
                "stamp the time, compute the group, refuse (close or 401) when it is None and the path is not "
                "public, else store the group and `await self.app(...)`. \"uvicorn did not start\" means the "
                "lifespan scope did not reach the app.",
            ),
            tests=(
                "tests/reliability/test_security.py::test_api_keys_compare_every_key_and_reject_bad_configurations",
                "tests/reliability/test_security.py::"
                "test_the_key_middleware_answers_401_itself_and_passes_a_valid_key_on_with_its_group",
                "tests/reliability/test_security.py::test_every_route_but_health_refuses_a_missing_or_wrong_key",
                "tests/reliability/test_security.py::test_unknown_paths_answer_401_without_a_key_and_404_with_one",
                "tests/reliability/test_security.py::test_a_route_added_after_create_app_is_protected_too",
                "tests/reliability/test_security.py::test_metrics_can_be_made_public_health_always_is",
            ),
        ),
        Task(
            name="trust_group_salt",
            file="stage5_server/server/auth.py",
            functions=("CacheSalter.salt",),
            minutes=10,
            spec="""
The prefix-cache salt of a trust group (and, when the server trusts clients with one, of a
client's own salt within it): a value nobody without the server's secret can compute.

In: the group, and an optional client salt. ``self._secret`` is the server's secret, drawn at start.

Out: 64 hex digits: ``hmac.new(self._secret, message, hashlib.sha256).hexdigest()`` of the
message ``b"stagedserve-cache-salt"``, a zero byte, the group (UTF-8), a zero byte, and, only when a
client salt is given, a byte of value 1 and the client salt (UTF-8).

Holds: keys of one group share a salt (and so share cached blocks); groups differ; the
separators keep ``("ab", None)`` and ``("a", "b")`` apart; the salt is stable for the server's
life; two servers (two secrets) give different salts for one group. The tests check the salts the
engine receives, and that only keys of one group get prefix-cache hits on each other's prompts.
""",
            hints=(
                "A keyed hash: the group is public, the key is not, so nobody can predict another group's salt.",
                "`hmac.new(key, msg, hashlib.sha256).hexdigest()`; bytes concatenate with `+`; "
                "`b'\\x00'` is a zero byte.",
                "Build `b'stagedserve-cache-salt\\x00' + group.encode() + b'\\x00'`, add "
                "`b'\\x01' + client_salt.encode()` when there is one, and return the HMAC's hex digest.",
            ),
            tests=(
                "tests/reliability/test_security.py::test_cache_salts_depend_on_the_server_secret",
                "tests/reliability/test_security.py::test_keys_in_one_trust_group_share_a_salt_and_groups_differ",
                "tests/reliability/test_security.py::test_only_keys_in_one_trust_group_share_prefix_cache_blocks",
            ),
        ),
        Task(
            name="sse",
            file="stage5_server/server/sse.py",
            functions=("sse",),
            minutes=5,
            spec="""
One server-sent event carrying ``data`` (a dict) as JSON.

Out: the text ``data: `` + the JSON + a blank line (two newlines). Non-ASCII text goes out as
itself, in UTF-8, not as escape sequences. A streamed response is a sequence of these, ended by
``SSE_DONE`` (``data: [DONE]``). The tests check one event exactly; the next task's tests then
stream whole completions through it.
""",
            hints=(
                "An SSE event is a `data:` line and an empty line that ends it.",
                "`json.dumps(data, ensure_ascii=False)`.",
                "One f-string: `f'data: {json.dumps(data, ensure_ascii=False)}\\n\\n'`.",
            ),
            tests=("tests/stage5/test_server_units.py::test_an_sse_event_is_one_data_line_of_json_then_a_blank_line",),
        ),
        Task(
            name="stream_deltas",
            file="stage5_server/engine/output_processor.py",
            functions=("RequestState.text_delta",),
            minutes=15,
            spec="""
The part of a request's text not streamed yet.

In: ``finished``; the request's state: ``self.text.visible(finished)`` (the text that may be
shown now: all of it once finished, before that less the characters that could still be the
start of a stop string), ``self.sent_chars`` and ``self.sent_tokens`` (what was already sent),
``self.token_ids``.

Out: ``(new text, first new token index, end token index)``, or None when an unfinished request
has nothing new to show. A finished request always gets an answer (maybe empty text): its last
chunk carries the finish reason.

Holds: what the client has received is always a prefix of the final text, so a stop string
never reaches it; ``sent_chars`` never moves backwards (the final, stop-trimmed text can be
shorter than what was held); ``sent_tokens`` becomes ``len(self.token_ids)``. The tests stream
``ab``, ``cdef``, ``ST`` then ``OP`` under the stop string ``STOP`` (nothing, ``abc``, ``de``, ``f``),
then whole streamed completions through the server.
""",
            hints=(
                "Streaming sends differences: the visible text minus what was already sent, where 'visible' "
                "already accounts for stop strings.",
                "`text[self.sent_chars:]` is the difference; `max(self.sent_chars, len(text))` is where the sent "
                "text ends.",
                "`text = self.text.visible(finished)`, `delta = text[self.sent_chars:]`; return None if it is "
                "empty and not finished; else remember `start = self.sent_tokens`, advance both counters, "
                "return `(delta, start, self.sent_tokens)`.",
            ),
            tests=(
                "tests/stage5/test_server_units.py::test_stop_strings_are_held_back_while_streaming",
                "tests/stage5/test_server_openai.py::test_sse_framing_is_data_lines_then_done",
                "tests/stage5/test_server_openai.py::test_stop_string_ends_the_text_before_it_streaming_or_not",
            ),
        ),
        Task(
            name="rejection_sample",
            file="stage5_server/spec_decode/rejection_sampler.py",
            functions=("rejection_sample",),
            minutes=30,
            spec="""
Speculative decoding's verification for one request: which drafts to keep, and the one token
after them.

In: ``target_probs [k + 1, vocab]``, the target's distribution at each draft position and after
the last draft; ``draft_token_ids`` (``k`` ids); ``draft_probs [k, vocab]``, the distributions the
drafts were drawn from, or None (each draft a point mass: ``q(d) = 1``); ``generator`` for every
random draw.

Out: the accepted drafts (a prefix of ``draft_token_ids``) followed by exactly one more token:
between 1 and ``k + 1`` tokens.

Holds: each returned token is distributed exactly as the target's distribution at its position,
whatever the drafts' distribution (a draft is kept with probability ``min(1, p(d) / q(d))``, the
rejection rule); with one-hot (greedy) target rows the drafts are kept exactly while they are the
argmax, then the argmax follows; a point-mass draft is kept with probability ``p(d)``. All
randomness comes from ``generator``. The tests run a chi-square test with a deliberately bad
draft distribution.
""",
            hints=(
                "Accept draft `d` when a uniform draw falls under `p(d) / q(d)`; on the first rejection the "
                "replacement must come from the probability mass acceptance left out, `max(0, p - q)`, "
                "normalized; if every draft is kept, a bonus token comes from the last row.",
                "`torch.rand((), generator=generator)` is one uniform draw; `torch.multinomial(weights, 1, "
                "generator=generator)` draws from unnormalized weights; `(p - q).clamp(min=0)` is the residual.",
                "For each draft: `u * q(d) < p(d)` keeps it and goes on; otherwise draw from the residual (for a "
                "point mass: `p` with `d` zeroed; if the residual has no mass left, from `p`), append, return. "
                "After the loop, append a draw from `target_probs[k]`.",
            ),
            tests=(
                "tests/stage5/test_rejection_sampler.py::test_output_distribution_is_the_targets_even_with_a_bad_draft",
                "tests/stage5/test_rejection_sampler.py::test_a_draft_without_probabilities_is_a_point_mass",
                "tests/stage5/test_rejection_sampler.py::"
                "test_greedy_keeps_drafts_while_they_are_the_argmax_then_the_argmax",
            ),
        ),
        Task(
            name="ngram_proposer",
            file="stage5_server/spec_decode/ngram_proposer.py",
            functions=("NgramProposer.propose",),
            minutes=20,
            spec="""
Prompt lookup: draft up to ``k`` tokens for a request from its own history.

In: the request's ``token_ids`` (prompt and output so far) and ``k`` (default ``self.k``); the
proposer's ``self.min_n`` and ``self.max_n``, the n-gram lengths it may match.

Out: a list of plain ints, at most ``k`` long: the tokens that followed the most recent earlier
occurrence of the request's last ``n`` tokens, for the longest ``n`` in ``[min_n, max_n]`` that
occurs; ``[]`` when ``k < 1``, when there are no more than ``min_n`` tokens, or when nothing
matches.

Holds: an occurrence ends before the last token (the suffix does not match itself, and at least
one token follows it); a longer match wins over a more recent shorter one; of the occurrences of
the winning ``n``, the one that starts last is used. So ``[1, 2, 3, 4, 1, 2]`` with ``k = 3``
drafts ``[3, 4, 1]``, and ``[7, 7]`` drafts ``[7]``. The engine test then checks the plain greedy
tokens with drafts accepted on repeated text.
""",
            hints=(
                "Text that repeats itself continues the way it continued last time: find the longest recent "
                "suffix match and copy what came after it.",
                "numpy's `sliding_window_view(tokens[:-1], n)` gives every window of `n` tokens that ends before "
                "the last one; `(windows == tokens[-n:]).all(axis=1)` marks the matches; `np.flatnonzero(mask)` "
                "their starts.",
                "For `n` from `min(self.max_n, len(token_ids) - 1)` down to `self.min_n`: if any window matches, "
                "take the last start `s` and return `tokens[s + n : s + n + k].tolist()`; after the loop, `[]`.",
            ),
            tests=(
                "tests/stage5/test_spec_decode.py::test_ngram_proposer_continues_the_most_recent_longest_match",
                "tests/stage5/test_spec_decode.py::test_ngram_proposer_prefers_a_longer_match_and_respects_its_bounds",
                "tests/stage5/test_spec_decode.py::test_ngram_engine_gives_the_plain_greedy_tokens_and_accepts_repeated_text",
            ),
        ),
        Task(
            name="int4_groups",
            file="stage5_server/quantization/weight_only.py",
            functions=("Int4Groups.quantize",),
            minutes=15,
            spec="""
Quantize a float weight ``[N, K]`` to 4-bit codes in groups of ``GROUP_SIZE`` (32) along ``K``,
the layout of a GGUF Q4_1 block.

Out: ``cls(codes, scale, zero)``: ``codes`` ``uint8 [N, K]``, each in ``0..15``; ``scale`` and
``zero`` ``[N, K // 32]``. The kernel reads a weight back as ``(code - 8) * scale + zero``.

Holds: each group's 16 codes span that group's own ``[min, max]`` evenly (code 0 is the
minimum, code 15 the maximum), so every weight reads back within half a scale of its value; a
constant group (max = min) reads back exactly, with every code 0 and a scale of 1.
""",
            hints=(
                "Per group, map `[min, max]` linearly onto `0..15` and round; then choose `zero` so that the "
                "kernel's `(code - 8) * scale + zero` gives `min` back at code 0.",
                "`weight.float().reshape(N, K // 32, 32)`; `groups.amin(-1)`, `groups.amax(-1)`; `[..., None]` "
                "broadcasts a per-group value back over its 32 weights; `torch.where(scale > 0, scale, "
                "torch.ones_like(scale))`.",
                "`scale = (max - min) / 15` (1 where it is 0), `codes = round((groups - min) / scale)` clamped to "
                "`0..15`, `zero = min + 8 * scale`; reshape the codes to `[N, K]` as `uint8`.",
            ),
            tests=(
                "tests/stage5/test_quantization.py::"
                "test_a_q4_1_block_is_one_int4_group_whose_zero_is_the_minimum_plus_eight_scales",
            ),
        ),
        Task(
            name="lora_delta",
            file="stage5_server/lora/layers.py",
            functions=("LoRALinearMethod._add_padded",),
            minutes=30,
            spec="""
Add every adapter's LoRA delta to a layer's output at once, for a step whose token rows use
several adapters. The shapes are the ones drawn on the LoRA page.

In: ``x [T, in]`` (the step's token rows) and ``out [T, out]`` (the base product, added to in
place). The adapter slots' weights are stacked, each zero-padded to ``R`` (slices x
``--max-lora-rank``): ``self.stacked_a [slots, R, in]`` and ``self.stacked_b [slots, R, out]``
(PEFT's ``B`` is ``[out, r]``; a slot holds it transposed). ``self.mapping`` describes the step
with ``S`` segments, one per slot in use: ``slots [S]`` (ascending), ``padded_rows [S * L]``
(segment ``s``'s token rows, padded to a common length ``L`` by repeating one of its rows) and
``padded_scaling [S, L, 1]`` (the slot's ``alpha / r``, 0 on the padding).

Holds afterwards: for every token row ``t`` of segment ``s``, ``out[t]`` has gained
``(x[t] A_s^T) B_s * scaling_s``, with ``A_s``, ``B_s`` its slot's stacked matrices; a padding
row adds nothing; rows of no segment (the base model's) are untouched, bit for bit. The work is
a fixed handful of batched operations whatever the number of adapters. The tests compare every
request's greedy tokens, with adapters and the base model mixed in one batch, against peft's.
""",
            hints=(
                "Lay the rows out as a padded batch `[S, L, in]`, one segment per adapter, so that one batched "
                "matmul shrinks every segment with its own `A` and one more expands it with its own `B`; the "
                "zero scaling on padding makes the repeated rows harmless.",
                "`tensor.index_select(0, idx)` gathers rows (or slots); `.view(S, -1, in)` makes the batch; "
                "`torch.bmm` multiplies batch by batch; `out.index_add_(0, rows, values)` adds rows back.",
                "`a, b = stacked_a[slots], stacked_b[slots]` (the stacks themselves when `S` is every slot); "
                "`xs = x.index_select(0, padded_rows).view(S, -1, x.shape[1])`; "
                "`delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b) * padded_scaling`; "
                "`out.index_add_(0, padded_rows, delta.view(-1, out.shape[1]))`.",
            ),
            tests=(
                "tests/stage5/test_lora.py::"
                "test_each_request_gets_peft_tokens_for_its_adapter_with_adapters_and_base_mixed_in_one_batch",
            ),
        ),
        Task(
            name="pooler",
            file="stage5_server/pooling/pooler.py",
            functions=("Pooler.pool_padded",),
            minutes=15,
            spec="""
One vector per prompt from an encoder's final hidden states.

In: ``hidden [batch, seq, dim]``, the prompts right-padded to ``seq`` (padding rows hold
arbitrary values, not zeros); ``lengths [batch]``, their true lengths; ``self.config.pooling_type``.

Out: ``self.finish(pooled)`` (it normalizes when the checkpoint asks) of ``pooled [batch, dim]``:
for ``"CLS"`` each prompt's first row, for ``"LAST"`` its last real row, for ``"MEAN"``
(all-MiniLM-L6-v2's) the mean of its real rows only, divided as sentence-transformers divides
(by the count of real rows, clamped below at ``1e-9``).

Holds: a prompt's vector is the same batched (padding present) as alone. The tests compare the
real all-MiniLM-L6-v2's embeddings with sentence-transformers', batched and one at a time.
""",
            hints=(
                "The whole difficulty is the padding: every reduction must see only each prompt's own rows.",
                "`torch.arange(seq)[None, :] < lengths[:, None]` is the `[batch, seq]` mask of real rows; "
                "`hidden[torch.arange(batch), lengths - 1]` picks one row per prompt.",
                "MEAN: `mask = (...).unsqueeze(-1).to(hidden.dtype)`, `(hidden * mask).sum(1) / "
                "mask.sum(1).clamp(min=1e-9)`; CLS: `hidden[:, 0]`; then `return self.finish(pooled)`.",
            ),
            tests=(
                "tests/stage5/test_pooling.py::test_embeddings_match_sentence_transformers_batched_and_one_at_a_time",
                "tests/stage5/test_pooling.py::test_score_is_the_cosine_similarity_of_the_embeddings",
            ),
        ),
        Task(
            name="compiled_step",
            file="stage5_server/model/compile.py",
            functions=("one_row_per_token",),
            minutes=20,
            spec="""
The step rewritten as decodes, so that the compiled graph, which attends one query row per
sequence, can run a step whose requests bring several tokens (a speculative verify step, a
short prompt).

In: ``meta``, the step's ``PagedAttentionMetadata`` (requests packed back to back:
``query_start_loc``, ``seq_lens``, ``block_tables`` one row per request, ``slot_mapping`` one
slot per token); ``positions [T]``, each token's position in its request.

Out: a ``PagedAttentionMetadata`` with one row per token: ``T`` queries of one token each
(``query_start_loc`` ``0, 1, ..., T``, int32; ``max_query_len`` 1); row ``i`` keeps token ``i``'s
slot (``slot_mapping`` unchanged), reads its own request's block table, and sees ``p + 1`` tokens,
``p`` its position (``seq_lens`` int32); ``max_seq_len`` stays.

Holds: because the attention operator writes every row's K/V before any row attends, row ``i``
sees exactly the tokens of its request up to itself: the causal mask, without a mask. The tests
compare the operator on these rows with the reference causal attention, and run verify steps and
a short prompt through the compiled graph, logprob-close to the eager forward.
""",
            hints=(
                "A query of `q` tokens at the end of a sequence is `q` decodes of growing length that share a "
                "block table.",
                "`meta.query_start_loc.diff()` is each request's token count; "
                "`tensor.repeat_interleave(counts, dim=0)` repeats each request's table row once per token.",
                "`PagedAttentionMetadata(slot_mapping=meta.slot_mapping, query_start_loc=torch.arange(T + 1, "
                "dtype=torch.int32), seq_lens=(positions + 1).to(torch.int32), block_tables=meta.block_tables"
                ".repeat_interleave(query_lens, dim=0), max_query_len=1, max_seq_len=meta.max_seq_len)`.",
            ),
            tests=(
                "tests/stage5/test_compiled_decode.py::"
                "test_a_step_of_several_positions_a_request_attends_causally_as_one_decode_row_per_token",
                "tests/stage5/test_compiled_decode.py::"
                "test_verify_steps_and_short_prompts_run_the_start_up_graphs_and_stay_close_to_eager",
            ),
        ),
        Task(
            name="image_hash",
            file="stage5_server/multimodal/inputs.py",
            functions=("hash_image",),
            minutes=5,
            spec="""
The identity of an image for the prefix cache.

In: a PIL image. Out: the hex SHA-256 digest of its mode, size and pixels: the text
``f"{image.mode}:{image.width}x{image.height}:"`` (encoded), then ``image.tobytes()``.

Holds: the same picture hashes the same whether it came from a file, a data URL or a URL; one
changed pixel, or the same bytes in another mode or shape, changes the hash. The hash joins the
keys of the KV blocks that hold the image's placeholders, so the same text with another image
shares no block after the image starts.
""",
            hints=(
                "Hash what the model sees (the decoded pixels and how to read them), not the file's bytes.",
                "`hashlib.sha256()`, its `.update(bytes)` (call it more than once) and `.hexdigest()`.",
                "`digest.update(f'{image.mode}:{image.width}x{image.height}:'.encode())`, then "
                "`digest.update(image.tobytes())`, and return `digest.hexdigest()`.",
            ),
            tests=(
                "tests/stage5/test_multimodal.py::test_an_image_hashes_by_its_mode_size_and_pixels_however_it_arrives",
            ),
        ),
        Task(
            name="image_placeholders",
            file="stage5_server/multimodal/processor.py",
            functions=("ImageProcessor.process",),
            minutes=25,
            spec="""
Turn a prompt with one image token per image into the ids the model runs and the images' features.

In: ``token_ids`` with one ``self.image_token_id`` per image, in order; ``images`` (PIL images);
``processor_kwargs`` for the Hugging Face image processor ``self.hf`` (a trusted request's).

Out: ``(expanded, features)``: ``expanded`` is ``token_ids`` with each image token replaced by
``self.num_image_tokens`` copies of it (one per feature vector the vision tower writes there:
for the tiny LLaVA, (40 / 8)^2 = 25 patches), every other token kept; ``features`` holds one
``MultiModalFeature.from_pixels(hash_image(image), offset, self.num_image_tokens, pixels)`` per
image, ``offset`` the index in ``expanded`` where its placeholders start and ``pixels`` the
processor's ``pixel_values[0]`` for the image converted to RGB.

Holds: a count of image tokens other than ``len(images)`` is a ``ValueError`` saying ``"the
prompt has N image placeholder(s) for M image(s)"``, raised before any work; an image too large
once resized is refused (``self.check_resized_size(width, height, processor_kwargs)``); a
``TypeError`` or ``ValueError`` from the processor becomes a ``ValueError`` naming
``mm_processor_kwargs``. The tests compare greedy tokens with transformers' LLaVA, an image
mid-prompt included, and split an image across prefill chunks.
""",
            hints=(
                "The prompt grows where each image sits; every later index moves, so the offsets are easiest "
                "to take while you build the expanded list.",
                "`self.hf(images=[image], return_tensors='pt', **(processor_kwargs or {}))['pixel_values'][0]`; "
                "`image.convert('RGB')`; `raise ValueError(...) from None` hides the processor's traceback.",
                "Count first and raise; then for each token: copy it, or (an image token) take the next image, "
                "check its size, compute its pixels under try/except, append the feature with offset "
                "`len(expanded)`, then extend `expanded` with `[self.image_token_id] * self.num_image_tokens`.",
            ),
            tests=(
                "tests/stage5/test_multimodal.py::test_greedy_tokens_match_transformers",
                "tests/stage5/test_multimodal.py::test_chunked_prefill_splits_an_image_and_encodes_it_once",
            ),
        ),
        Task(
            name="pipeline_batch_queue",
            file="stage5_server/core/engine_core.py",
            functions=("EngineCore.step_with_batch_queue",),
            minutes=30,
            spec="""
One step of an engine whose model is split into ``P`` pipeline stages: keep up to
``self.max_batches_in_flight`` (``P``) batches in flight, so that each stage works on a
different batch.

In: ``self.batch_queue`` (a deque of ``(scheduler_output, pending_result)``, oldest first),
``self.schedule()``, ``self.model_executor.execute_model_async(output)`` (returns a pending
result with ``.result()``), ``self.scheduler.in_flight`` (request ids the scheduler must skip
until their tokens are back).

Out: this call's engine outputs: ``self.update(output, result)`` for the batch it waited for, or
``self.finished_outside_step()`` when it waited for none.

Holds:

- while the queue has room, a new batch is scheduled and, if it has tokens, sent, queued, and its
  request ids added to ``in_flight``; while there is still room after that, the call returns
  without waiting (the next batch is scheduled before any result is awaited);
- otherwise (or when scheduling found nothing new) the oldest batch is taken off the queue, its
  ids leave ``in_flight``, and its result is awaited and applied; an empty queue returns
  ``finished_outside_step()``;
- a request is never in two batches in flight; ``self.most_batches_in_flight`` records the
  deepest the queue has been;
- a failure sending or awaiting a batch raises ``StepFailed(scheduler.step_failed(output), exc)``.

The tests compare the greedy tokens with one process and transformers, and watch two batches in
flight with no request in both.
""",
            hints=(
                "A pipeline stays busy only if the next batch is sent before the previous one is back; the "
                "scheduler must not schedule a request whose tokens are still in flight.",
                "`set.update` and `set.difference_update` take the dict of scheduled tokens (its keys); "
                "`queue.popleft()` is the oldest batch, and the stages finish batches in the order they were sent.",
                "`if len(queue) < max:` schedule; if `output.total_num_scheduled_tokens`, send it under try "
                "(StepFailed on error), append, update `in_flight` and `most_batches_in_flight`, and return "
                "`finished_outside_step()` if there is still room. Then: empty queue -> "
                "`finished_outside_step()`; else popleft, `difference_update`, `pending.result()` under try, "
                "`return self.update(output, result)`.",
            ),
            tests=(
                "tests/stage5/test_pipeline_parallel.py::test_greedy_tokens_are_identical_to_one_process_and_to_transformers",
                "tests/stage5/test_pipeline_parallel.py::test_two_batches_are_in_flight_and_no_request_is_in_both",
            ),
        ),
        Task(
            name="offload_lookup",
            file="stage5_server/kv_transfer/offload.py",
            functions=("OffloadingConnector.get_num_new_matched_tokens",),
            minutes=15,
            spec="""
The offload tier's answer to a prefix lookup: how many tokens past the local hit it can supply.

In: the request; ``num_computed_tokens``, its local prefix-cache hit (whole blocks); its
full-block hashes ``block_hashes`` (as far as a hit may reach). The tier holds the blocks whose
hashes are keys of ``self.slot_of``.

Out: the tokens the tier can add, a multiple of ``self.block_size``: the run of consecutive
blocks it holds, starting at the first block after the local hit, and ending before the first
block it lacks (a block is useful only if every block before it is there too).

Holds: ``self.matched[request.request_id]`` is the list of those blocks' hashes, in order, even
when empty (``update_state_after_alloc`` pairs them with the blocks the pool gives them, and pops
the entry). Nothing else changes: the tier's LRU order moves only when blocks are really loaded.
""",
            hints=(
                "A lookup extends the local hit block by block and stops at the first gap.",
                "`stored_run(block_hashes, start_block, is_stored)` (`kv_transfer/base.py`) returns that run; "
                "`self.slot_of.__contains__` is a ready-made `is_stored`.",
                "`found = stored_run(block_hashes, num_computed_tokens // self.block_size, "
                "self.slot_of.__contains__)`; store it in `self.matched[request.request_id]`; return "
                "`len(found) * self.block_size`.",
            ),
            tests=(
                "tests/stage5/test_kv_transfer.py::test_the_tier_lookup_counts_the_run_of_stored_blocks_after_the_local_hit",
                "tests/stage5/test_kv_transfer.py::test_offloaded_blocks_come_back_after_eviction_with_the_same_greedy_tokens",
                "tests/stage5/test_kv_transfer.py::test_a_block_offloaded_for_one_trust_group_or_adapter_is_never_read_for_another",
            ),
        ),
    ],
}


def task(stage: int, name: str) -> Task:
    """The task called ``name`` in ``stage``; a ValueError lists the names there are."""
    if stage not in TASKS:
        raise ValueError(f"stage: choose one of {sorted(TASKS)}, got {stage}")
    for candidate in TASKS[stage]:
        if candidate.name == name:
            return candidate
    raise ValueError(f"task: stage {stage} has {[t.name for t in TASKS[stage]]}, not {name!r}")
