"""The exercises: one task per blanked function, with its spec, hints and the tests that judge it.

``scripts/make_exercises.py`` reads this table to write a learner's copy (each listed function
keeps its signature, its docstring gains the spec below, its body becomes
``raise NotImplementedError``), to check a copy task by task, and to render the Exercises
section of each stage page (``docs/snippets/exercises_stageN.md``).

Tasks of a stage are done in order: a task's tests use only the functions of the tasks before
it (and code that is never blanked), so with tasks 1..k-1 solved, tasks 1..k-1 pass and task k
fails. ``tests/test_exercises.py`` holds every stage to exactly that, from a blank copy to a
fully solved one.

``tests`` are pytest node ids, relative to the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    name: str  # what the learner types: make check STAGE=N TASK=name
    file: str  # the file that holds the function, relative to the repository root
    functions: tuple[str, ...]  # what the learner writes: "function" or "Class.method", all in ``file``
    spec: str  # what the tests pin; goes into the blanked function's docstring
    hints: tuple[str, ...]  # shown one by one on the stage page and by make hint
    tests: tuple[str, ...]  # pytest node ids that judge this task and nothing else
    minutes: int = 15  # about how long the task takes a learner who has read the stage's page


S1 = "tests/stage1/test_contiguous_kv_cache.py::"
S2 = "tests/stage2/test_paged_kv.py::"
S3 = "tests/stage3/test_scheduler.py::"
S4_CORE = "tests/stage4/test_prefix_cache_core.py::"
S4_POOL = "tests/stage4/test_block_pool.py::"
S4_SCHED = "tests/stage4/test_prefix_cache_scheduling.py::"


TASKS: dict[int, list[Task]] = {
    1: [
        Task(
            name="reserve",
            file="stage1_naive/kv_cache.py",
            functions=("ContiguousKVCache.reserve",),
            spec="""
Reserve ``num_slots`` contiguous slots for ``request_id`` by first fit and return the start slot.

- Walk ``self.free_extents`` (kept sorted by start) and take the first extent at least
  ``num_slots`` long: the reservation starts where that extent starts, and the extent
  shrinks from the front (or disappears when it is used up exactly).
- Record ``self.reservations[request_id] = Extent(start, num_slots)`` and
  ``self.written[request_id] = 0``: ``reserved_slots``, ``used_slots`` and
  ``internal_fragmentation`` are computed from these two dicts.
- No extent is long enough: return None and change nothing.
- ``request_id`` already holds a reservation: raise ``ValueError`` whose message starts
  with ``request_id:``.
""",
            hints=(
                "Loop with `for i, extent in enumerate(self.free_extents)`: you need the index to "
                "shrink or delete the extent in place.",
                "Shrinking an extent that starts at `s` with length `n` by `k` slots leaves "
                "`Extent(s + k, n - k)`.",
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
            spec="""
Return ``request_id``'s extent to the free list.

- Remove the request from ``self.reservations`` and ``self.written``.
- Put its extent back into ``self.free_extents`` so that the list stays sorted by start and
  no two free extents touch: an extent that ends where the next one starts is merged with it,
  on either side of the released one. A later ``reserve`` can then use the whole merged hole.
- The static-batching engine (``NaiveEngineCore``) calls this for every member of a batch
  once the whole batch has finished; the engine test checks that reservations stay held
  until then and that the next batch is admitted afterwards.
""",
            hints=(
                "Append the extent, sort by `start`, then make one pass that merges each extent "
                "into the previous one when `prev.start + prev.length == e.start`.",
            ),
            tests=(
                S1 + "test_reservations_are_first_fit_and_merge_on_release",
                S1 + "test_release_merges_a_hole_with_free_neighbours_on_both_sides",
                S1 + "test_static_batch_holds_reservations_until_its_slowest_member_ends",
            ),
        ),
        Task(
            name="external_fragmentation",
            file="stage1_naive/kv_cache.py",
            functions=("ContiguousKVCache.external_fragmentation",),
            spec="""
Free slots that a reservation of ``request_slots`` cannot use.

Those are the slots of every free extent strictly shorter than ``request_slots``: free memory,
but in holes too small for the request. A hole exactly ``request_slots`` long is usable and
does not count.
""",
            hints=("One `sum(...)` over `self.free_extents` with a condition.",),
            tests=(S1 + "test_external_fragmentation_counts_free_holes_too_small_for_a_reservation",),
        ),
    ],
    2: [
        Task(
            name="blocks_needed",
            file="stage2_paged/block_table.py",
            functions=("BlockTable.blocks_needed",),
            spec="""
How many more blocks this table needs so that ``num_tokens`` tokens have slots.

``num_tokens`` tokens need ``ceil(num_tokens / block_size)`` blocks in all; the table already
holds ``len(self.block_ids)``. Return the difference, and 0 (never a negative number) when the
table already covers ``num_tokens``. ``grow`` allocates exactly this many, so a table grows
only when a block fills.
""",
            hints=(
                "Integer ceiling without floats: `-(-a // b)`.",
                "Clamp with `max(0, ...)`: a table that shrank its sequence never gives blocks back here.",
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
            spec="""
The flat KV-cache slots of positions ``start .. end - 1`` of a sequence whose blocks are ``block_ids``.

Position ``p`` sits in logical block ``p // block_size`` at offset ``p % block_size``; the table
maps the logical block to a physical block id, and the slot is
``block_ids[p // block_size] * block_size + p % block_size``. Return the list of slots, one per
position, in order (empty when ``start == end``). The blocks need not be adjacent: the tests
shuffle the free list, so physical ids come in any order. Every later stage (stage 3's
engine, tensor parallelism) addresses K/V through this one function.
""",
            hints=("One list comprehension over `range(start, end)`.",),
            tests=(
                S2 + "test_seed_example_a_to_h_occupies_two_blocks_that_need_not_be_adjacent",
                S2 + "test_slot_mapping_follows_the_table_across_scattered_blocks",
            ),
        ),
        Task(
            name="gather_kv",
            file="stage2_paged/attention.py",
            functions=("gather_kv",),
            spec="""
The first ``seq_len`` token rows of one sequence's K (or V), read through its block table.

``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_table`` is a 1-D
tensor of physical block ids in logical order (padded past the sequence's last block).
Return ``[seq_len, num_kv_heads, head_dim]``: row ``p`` is position ``p``, taken from
``cache[block_table[p // block_size], p % block_size]``. ``paged_attention`` uses it for every
sequence with more than one query row, so the paged result must equal dense attention over
the gathered keys, for block sizes 1, 4 and 16 and GQA groups 1, 2 and 4; the engine test then
runs sixteen requests through a paged stage 2 ``LLM``.
""",
            hints=(
                "Index the cache with the first `ceil(seq_len / block_size)` ids at once "
                "(`cache[ids]` is `[n, block_size, H, D]`), flatten the first two dims, cut to `seq_len`.",
                "Index tensors must be integer (long) tensors.",
            ),
            tests=(
                S2 + "test_gather_kv_returns_positions_in_logical_order",
                S2 + "test_paged_attention_equals_dense_attention_on_gathered_keys",
                S2 + "test_stage2_admits_by_blocks_where_stage1_reserves_max_model_len",
            ),
        ),
    ],
    3: [
        Task(
            name="update_from_output",
            file="stage3_continuous/scheduler.py",
            functions=("Scheduler.update_from_output",),
            spec="""
Advance every request the step scheduled, append the tokens it sampled, finish what must stop.

For each ``request_id, num_new`` in ``scheduler_output.num_scheduled_tokens``:

- Skip a request that is no longer in ``self.requests`` or is already finished (it was aborted
  while its step ran).
- Count the prompt positions this step computed in ``self.counters.num_prompt_tokens_computed``
  (only the part of ``num_new`` that was still prompt), then add ``num_new`` to
  ``request.num_computed_tokens``.
- For each token in ``sampled_token_ids.get(request_id, [])`` (empty for a request in the
  middle of a chunked prefill): ``request.append_output_token(token, now)`` (this records the
  token's time in the request's timeline), add one to ``self.counters.num_generation_tokens``,
  and if ``check_stop(request, self.max_model_len)`` says it is finished, remove it from
  ``self.running`` and ``self._free(request)`` it (its blocks return to the pool, its id is
  reported in the next ``SchedulerOutput.finished_req_ids``), then stop reading its tokens.
- Return the requests that were given at least one token, in order.

Add one to ``self.counters.num_steps`` per call. ``now`` is one ``time.monotonic()`` for the
whole step. The tests build each step's ``SchedulerOutput`` by hand, so this task needs no
``schedule()``; it pins prefill chunks that sample nothing, the counters, EOS, stop tokens and
``max_tokens``, freeing, and a request aborted while its step ran.
""",
            hints=(
                "`shared.request.check_stop` sets the finished status (and `stop_reason`) itself; you only "
                "act on its answer.",
                "A request still in its prompt has `num_computed_tokens < num_prompt_tokens`: only "
                "`min(num_new, num_prompt_tokens - num_computed_tokens)` of this step's tokens were prompt.",
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
            spec="""
Decide the next forward pass: which requests run and how many input positions each computes.

Spend ``budget = self.config.max_num_batched_tokens`` in two phases and return a
``SchedulerOutput``.

1. Running requests first, in ``self.running`` order (admission order). Each asks for
   ``num_tokens - num_computed_tokens`` tokens, at most the budget left: one for a decode, the
   rest of its prompt for a request in the middle of a chunked prefill. Back them with
   ``self.kv_cache_manager.allocate_slots(request, num_new)``; ``None`` means no room: preempt
   the victim with the largest ``(priority, arrival_time)`` among the requests not yet granted
   tokens this step (this one included), remove it from ``self.running``, call
   ``self._preempt(victim)``, record its id in ``preempted``, and retry; if the victim was this
   request, stop trying it. Stop when the budget is spent or ``max_num_seqs`` requests are
   scheduled.
2. Waiting requests, only if nothing was preempted this step, while budget is left, fewer than
   ``max_num_seqs`` are scheduled and ``len(self.running) < self.config.running_cap`` (the
   ``max_num_active_seqs`` cap). Take them in policy order (``self._peek_waiting()``: FCFS, or
   lowest ``priority`` then earliest arrival). Ask ``get_computed_blocks(request)`` for
   prefix-cache hits (always none in stage 3; stage 4 reuses this loop), schedule
   ``num_tokens - num_computed`` tokens, cut to the budget; with
   ``enable_chunked_prefill=False`` a prompt that does not fit whole waits (stop admitting).
   If ``allocate_slots(request, num_new, num_computed, computed_blocks)`` is None, stop: it
   stays first in line. Otherwise move it from ``self.waiting`` to ``self.running``, set its
   status to RUNNING, ``num_computed_tokens`` and ``num_cached_tokens`` to the hit, and
   ``timeline.first_scheduled`` to ``time.monotonic()`` the first time only (queue time is
   measured to it, and a resumed request keeps its first one).
3. The output: ``scheduled_new_reqs`` (admitted this step, including resumed ones),
   ``scheduled_running_reqs``, ``num_scheduled_tokens`` (id -> tokens),
   ``total_num_scheduled_tokens``, ``block_tables`` (``kv_cache_manager.get_block_ids`` of every
   scheduled request), ``preempted_req_ids`` and ``finished_req_ids`` (then reset
   ``self.finished_req_ids`` to a new empty set).

The tests pin the seed's budget-6 trace (R0 decodes 1 token every step; R1's nine-token prompt
goes in as 5 + 4; then R1 decodes), the running cap, ``max_num_seqs``, the priority order,
a request mid-prefill keeping its place, aborts, and, through the whole engine, the budget and
the caps holding every step while requests join others that are decoding.
""",
            hints=(
                "Write phase 1 with an index into `self.running` rather than a for loop: preemption "
                "removes elements while you walk.",
                "Python's `while ...: ... else:` runs the `else` only when the loop ended without "
                "`break`: handy for 'allocated without giving up on this request'.",
                "The budget counts input positions, not output tokens: a request that finishes its "
                "prompt this step samples its first token from this step's logits.",
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
                "tests/invariants/test_scheduling_invariants.py::"
                "test_token_budget_and_sequence_caps_hold_every_step[stage3_continuous]",
                "tests/invariants/test_scheduling_invariants.py::"
                "test_requests_join_while_others_are_decoding[stage3_continuous]",
            ),
        ),
        Task(
            name="preempt",
            file="stage3_continuous/scheduler.py",
            functions=("Scheduler._preempt",),
            spec="""
Preempt ``request`` by recompute (the caller has already removed it from ``self.running``).

- Free all its KV blocks (``self.kv_cache_manager.free(request)``) and set
  ``num_computed_tokens`` to 0: when it runs again it re-prefills its prompt *and* the tokens
  it had generated, which it keeps.
- Set its status to ``RequestStatus.PREEMPTED``, add one to ``request.num_preemptions`` and to
  ``self.counters.num_preemptions`` (the stats line and ``vllm:num_preemptions`` read it).
- Put it at the *front* of ``self.waiting``, ahead of requests that never ran.

The tests pin a four-block pool where the newest request is the one preempted, keeps its three
output tokens, waits first in line, and re-prefills 6 + 3 = 9 tokens when room returns; and
greedy outputs that do not change when a small pool forces preemptions.
""",
            hints=(
                "`deque.appendleft` puts an element at the front.",
                "Do not touch `self.running` here: `schedule` removed the victim already.",
            ),
            tests=(
                S3 + "test_preemption_by_recompute_frees_the_newest_and_requeues_it_first_with_its_tokens",
                "tests/invariants/test_scheduling_invariants.py::"
                "test_preemption_is_transparent_to_greedy_outputs[stage3_continuous]",
            ),
        ),
    ],
    4: [
        Task(
            name="hash_request_tokens",
            file="stage4_prefix_cache/kv_cache_utils.py",
            functions=("hash_request_tokens",),
            spec="""
The chained hashes of every *full* block of ``token_ids``, from the first block on.

Block ``i`` covers ``token_ids[i * block_size : (i + 1) * block_size]``; its hash is
``hash_block_tokens(parent, block_tokens, extra_keys, hash_fn)`` where ``parent`` is block
``i - 1``'s hash (None for block 0). So equal tokens after different prefixes get different
hashes, and a salt in ``extra_keys`` changes every hash. A trailing partial block
is never hashed (its contents will still change). ``block_size`` that is not a positive
integer is a ``ValueError`` naming ``block_size``.
""",
            hints=(
                "`range(0, len(token_ids) - block_size + 1, block_size)` yields the start of every "
                "full block.",
            ),
            tests=(
                S4_CORE + "test_hash_is_the_parent_then_tokens_then_extra_keys",
                S4_CORE + "test_bad_hash_inputs_are_value_errors_naming_the_field",
                S4_POOL + "test_request_hashes_chain_full_blocks_and_skip_the_partial_one",
                S4_POOL + "test_extra_keys_change_every_block_hash_of_a_request",
            ),
        ),
        Task(
            name="free_blocks",
            file="stage4_prefix_cache/block_pool.py",
            functions=("BlockPool.free_blocks",),
            spec="""
Drop one user from each block of ``ordered_blocks``, in the order given.

A block whose ``ref_cnt`` reaches 0 enters ``self.free_block_queue`` at once, one block at a
time: a cached block (``block_hash`` set) at the *tail* (kept as long as possible, in case
someone shares it), an uncached one (a partial block) at the *head* (its contents are useless:
reuse it first). A block that still has users stays out of the queue. Freeing does not touch
hashes: a free, cached block still answers ``get_cached_block`` until an allocation pops it.
(``KVCacheManager.free`` passes a request's table in reverse, so a sequence's tail leaves before
its prefix.)
""",
            hints=(
                "`self.free_block_queue.append(block)` is the tail, `.appendleft(block)` the head.",
            ),
            tests=(
                S4_POOL + "test_freed_blocks_queue_one_by_one_cached_to_the_tail_uncached_to_the_head",
                S4_POOL + "test_a_freed_cached_block_keeps_its_hash_until_it_is_reused",
            ),
        ),
        Task(
            name="touch",
            file="stage4_prefix_cache/block_pool.py",
            functions=("BlockPool.touch",),
            spec="""
Record a prefix-cache hit on each block of ``blocks``: one more user each.

A hit block with no users (``ref_cnt == 0``) is sitting in the free queue as an eviction
candidate: take it out (``self.free_block_queue.remove(block)``, O(1) from anywhere) *before*
counting the new user, so it can no longer be evicted while in use. Its hash stays.
``KVCacheManager.allocate_slots`` touches the hits before it allocates fresh blocks, so the
request's own new blocks can never evict the block it just hit.
""",
            hints=("Only blocks with `ref_cnt == 0` are in the free queue.",),
            tests=(
                S4_POOL + "test_touch_adds_a_user_to_a_block_in_use",
                S4_POOL + "test_touch_takes_a_free_cached_block_out_of_the_free_queue",
                S4_POOL + "test_a_touched_block_returns_to_the_queue_only_when_its_last_user_frees_it",
            ),
        ),
        Task(
            name="get_computed_blocks",
            file="stage4_prefix_cache/kv_cache_manager.py",
            functions=("KVCacheManager.get_computed_blocks",),
            spec="""
The longest run of cached blocks that matches the request from its first token.

Return ``(blocks, num_computed_tokens)``. With caching off, return ``([], 0)`` and count
nothing. Otherwise take the request's full-block hashes (``self._get_block_hashes(request)``,
which includes its cache salt), and walk them from the start, looking each up with
``self.block_pool.get_cached_block``; stop at the first miss. The hit is capped at
``num_tokens - 1`` tokens, rounded down to whole blocks: the last prompt position is always
computed, because its logits give the first output token. So with block size 4 a prompt sharing
6 tokens (``A B C D E F``) with a cached one reuses 4; a fully cached 8-token prompt also reuses
only 4; a 9-token prompt whose first 8 are cached reuses 8. Count the lookup in
``self.prefix_cache_stats``: ``requests += 1``, ``queries += num_tokens``,
``hits += num_computed_tokens``. Reserve nothing: ``allocate_slots`` touches the hits.
""",
            hints=(
                "At most `(request.num_tokens - 1) // self.block_size` blocks can hit.",
                "The tests compare the returned blocks with the earlier request's table: return the "
                "block objects from the pool, not copies.",
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
            spec="""
The Triton kernel that writes this step's new K and V rows into their cache slots.

One program per token: ``token = tl.program_id(0)``. Load its flat slot from
``slot_mapping_ptr + token`` (as int64); a negative slot is a padding token: return without
writing. Otherwise the slot splits into ``block_id = slot // BLOCK_SIZE`` and
``offset = slot % BLOCK_SIZE``. Load the token's key, all KV heads by all dims at once: a
``[BLOCK_H, BLOCK_D]`` tile from ``key_ptr + token * stride_kt + heads * stride_kh + dims *
stride_kd`` with ``heads = tl.arange(0, BLOCK_H)``, ``dims = tl.arange(0, BLOCK_D)`` and a mask
``heads < num_kv_heads`` and ``dims < HEAD_DIM`` (the tile is padded to powers of two). Store it
at ``key_cache[block_id, offset]`` through the cache's four strides, cast to the cache's element
type, under the same mask; the same for the value. Inputs may be non-contiguous views: use the
strides, never assume them. The test runs under ``TRITON_INTERPRET=1`` (the test suite sets it
without a GPU) and compares every slot exactly, for block sizes 8 and 16, fp32 and fp16.
""",
            hints=(
                "`tl.load(ptrs, mask=mask)` and `tl.store(ptrs, values, mask=mask)` take a tile of pointers: "
                "build it with broadcasting, `heads[:, None] * stride + dims[None, :] * stride`.",
                "`key_cache_ptr.dtype.element_ty` is the cache's element type, for `.to(...)`.",
            ),
            tests=("tests/stage5/test_triton_kernels.py::"
                   "test_reshape_and_cache_writes_each_token_to_its_slot_and_skips_negative_slots",),
        ),
        Task(
            name="workers_view",
            file="stage5_server/core/scheduler.py",
            functions=("Scheduler._for_workers",),
            spec="""
Stage 4's decision for a step (``live``: its ``SchedulerOutput``, with live ``Request`` objects) as
every worker receives it: plain data, each request whole the first time the workers see it and
afterwards only what it gained since.

- ``self.sent_to_workers`` maps a request id to ``[tokens, blocks]`` the workers hold. First forget
  every request of ``self.finished_on_workers`` and ``self.preempted_on_workers`` there: a
  preempted request comes back whole.
- Each scheduled running request's drafts (``live.scheduled_running_reqs``): its
  ``spec_token_ids`` cut to ``live.num_scheduled_tokens[id] - 1`` (the budget may have cut some)
  go into a dict of drafts when any are left; then its ``spec_token_ids`` become ``[]``.
- For each request of ``live.scheduled_reqs`` (the running ones, then the new ones), its blocks are
  ``self.kv_cache_manager.req_to_blocks[id]``. A request the workers do not hold becomes a
  ``NewRequestData`` (its prompt and output tokens, sampling parameters, EOS and bad-words ids, block
  ids, ``num_computed_tokens``, ``len(request.prompt_logprobs)``, images and adapter), and the workers
  now hold ``[request.num_tokens, len(blocks)]``. A request they hold adds to one
  ``CachedRequestData`` its id, the tokens after the ones they hold, the block ids after theirs and its
  ``num_computed_tokens``; what they hold is updated.
- Reset ``finished_on_workers`` and ``preempted_on_workers`` to empty sets and return
  ``SchedulerOutput(new, cached, num_scheduled_tokens, live.total_num_scheduled_tokens, drafts,
  finished, preempted)``, the counts in the order the workers pack the requests: the cached ones,
  then the new ones.

The tests run stage 5 offline and compare the persistent input batch the workers build from these
messages with the inputs stage 3 builds from the live requests, step after step, through chunked
prefill, preemption and aborts.
""",
            hints=(
                "`request.all_token_ids[num_tokens:]` is what a running request gained since the workers last "
                "saw it; `blocks[num_blocks:]` the blocks it gained.",
                "Keep the sets to send (`finished`, `preempted`) before you reset the attributes.",
            ),
            tests=(
                "tests/stage5/test_input_batch.py::"
                "test_inputs_match_the_list_built_ones_through_chunked_prefill_and_preemption",
                "tests/stage5/test_input_batch.py::test_an_aborted_request_id_taken_again_gets_a_fresh_row",
                "tests/stage5/test_input_batch.py::test_rows_of_requests_aborted_while_nothing_ran_are_taken_back",
            ),
        ),
        Task(
            name="authenticate",
            file="stage5_server/server/auth.py",
            functions=("APIKeys.authenticate",),
            spec="""
The trust group of the API key ``token``, or None if it is no configured key (or is None).

Compare in constant time: hash the token with SHA-256 and compare the digest with *every*
configured key's digest (``self._digests``, pairs of digest and group) using
``hmac.compare_digest``, without stopping at the first match, so the time taken says nothing
about which key (or how much of one) matched. Keys in one group give that group; a key
configured without a group has a group of its own (``key#3``); a near miss (``"k1 "``) is None.
""",
            hints=(
                "Remember the matching group in a variable and return it after the loop.",
            ),
            tests=("tests/reliability/test_security.py::test_api_keys_compare_every_key_and_reject_bad_configurations",),
        ),
        Task(
            name="auth_middleware",
            file="stage5_server/server/auth.py",
            functions=("APIKeyMiddleware.__call__",),
            spec="""
The ASGI middleware around the whole app: no valid key, no entry (``public_paths`` excepted).

- Scopes other than ``"http"`` and ``"websocket"`` (the lifespan) pass straight to ``self.app``.
- Record ``scope[RECEIVED_SCOPE_KEY] = time.monotonic()``: the request's timeline starts here.
- The group: ``PUBLIC_GROUP`` when the server has no keys (``self.keys is None``), else
  ``self.keys.authenticate(_bearer_token(scope))``.
- No group and the route path (``_route_path(scope)``) not in ``self.public_paths``: refuse. A
  websocket gets ``{"type": "websocket.close", "code": 1008}``; HTTP gets ``send_json(send, 401,
  error_body("Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
  "invalid_request_error", None, "invalid_api_key"), [(b"www-authenticate", b"Bearer")])``.
- Otherwise set ``scope[TRUST_GROUP_SCOPE_KEY] = group`` and call ``self.app``.

Because it runs before routing, every route is covered, including ones added after
``create_app`` and paths that do not exist (401 without a key, 404 with one). The tests try
every route with no key, a wrong key and a Basic header; ``/health`` stays open, ``/metrics``
only when the server makes it public.
""",
            hints=(
                "Everything you need is already in `auth.py`: `_bearer_token`, `_route_path`, and `send_json` "
                "and `error_body` from `server/errors.py`.",
                "An ASGI middleware is `async def __call__(self, scope, receive, send)` that either answers "
                "itself (through `send`) or awaits `self.app(scope, receive, send)`.",
                "\"uvicorn did not start\" means the lifespan scope did not reach the app: only http and "
                "websocket scopes are checked.",
            ),
            tests=(
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
            spec="""
The prefix-cache salt of a trust group (and, when the server trusts clients with one, of a
client's own salt within it): an HMAC that nobody without the server's secret can compute.

Return ``hmac.new(self._secret, message, hashlib.sha256).hexdigest()``, where ``message`` is the
bytes ``stagedserve-cache-salt``, a zero byte, the group (UTF-8), a zero byte, and, when a client
salt is given, a byte of value 1 and the client salt (UTF-8). The separators keep ``("ab", None)`` and
``("a", "b")`` apart. So: keys of one group share a salt (and so share cached blocks), groups
differ, the salt is 64 hex digits and stable for the server's life, and two servers (two
secrets) give different salts for the same group. The tests check the salts the engine
receives and that only keys of one group get prefix-cache hits on each other's prompts.
""",
            hints=(
                "`hmac.new(key, msg, hashlib.sha256).hexdigest()` is a 64-character hex string.",
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
            spec="""
One server-sent event: ``data: `` then ``data`` as JSON, then a blank line (two newlines).

``json.dumps(data, ensure_ascii=False)``: non-ASCII text goes out as itself, in UTF-8. A
streamed response is a sequence of these, ended by ``SSE_DONE`` (``data: [DONE]``). The tests
check one event exactly; the next task's tests then stream whole completions through it (every
block starts with ``data: ``, a usage chunk comes last, then ``[DONE]``).
""",
            hints=("One f-string.",),
            tests=("tests/stage5/test_server_units.py::test_an_sse_event_is_one_data_line_of_json_then_a_blank_line",),
        ),
        Task(
            name="stream_deltas",
            file="stage5_server/engine/output_processor.py",
            functions=("RequestState.text_delta",),
            spec="""
The part of the text not streamed yet: ``(new text, first new token index, end token index)``, or
None when there is nothing to send yet.

The text that may be shown is ``self.text.visible(finished)``: all of it once the request is
finished; before that, less the last characters that could still turn out to be the start of a
stop string (which must never reach the client). The delta is that text after the
``self.sent_chars`` characters already sent; an empty delta of an unfinished request is None.
Otherwise advance ``self.sent_chars`` (never backwards: the final, stop-trimmed text can be
shorter than what was held) and ``self.sent_tokens`` (to ``len(self.token_ids)``) and return the
delta with the token range it covers. The tests stream ``ab``, ``cdef``, ``ST`` then ``OP`` under
the stop string ``STOP``: nothing, ``abc``, ``de``, ``f``; then whole streamed completions through
the server: the SSE framing (every block a ``data:`` line, the text reassembled, the finish reason
on the last text chunk, usage, ``[DONE]``) and a stop string that ends the text before it,
streamed or not.
""",
            hints=(
                "`text[self.sent_chars:]` is the delta; `max(self.sent_chars, len(text))` is where it ends.",
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
            spec="""
The rejection rule of speculative decoding for one request: which drafts to keep, and the one
token after them.

``target_probs`` has ``k + 1`` rows: the target's distribution at each draft position and after
the last draft; ``draft_probs`` has ``k`` rows, the distributions the drafts were drawn from, or
is None (a draft with no probabilities is a point mass: ``q(d) = 1``). Position by position, draw
``u`` uniform in [0, 1) from ``generator`` and accept draft ``d`` when ``u * q(d) < p(d)``
(probability ``min(1, p(d) / q(d))``). On the first rejection, draw one token from the residual
``max(0, p - q)`` (for a point mass: ``p`` with ``d`` set to 0), normalized, append it and stop;
if the residual has no mass left, draw from ``p``. If every draft is accepted, append a bonus
token drawn from the last row. Return the accepted drafts and that one token. The tests run a
chi-square test with a deliberately bad draft distribution (the kept tokens must be distributed
as the target's), check that a point-mass draft is kept with probability ``p(d)``, and that under
greedy target rows (one-hot) the drafts are kept exactly while they are the argmax.
""",
            hints=(
                "`torch.rand((), generator=generator)` is one uniform draw; `torch.multinomial(weights, 1, "
                "generator=generator)` draws from unnormalized weights.",
                "`(p - q).clamp(min=0)` is the residual; the loop returns as soon as a draft is rejected.",
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
            spec="""
Draft up to ``k`` tokens for a request from its own history: the tokens that followed the most
recent earlier occurrence of its last ``n`` tokens.

``k`` defaults to ``self.k``. Return ``[]`` when ``k < 1`` or there are no more than
``self.min_n`` tokens. Try ``n`` from ``min(self.max_n, len(token_ids) - 1)`` down to
``self.min_n``: the suffix is the last ``n`` tokens; an occurrence is a window of ``n`` tokens
equal to it that ends before the last token (so at least one token follows it, and the suffix
does not match itself). The first ``n`` with an occurrence wins (a longer match is better
evidence); of its occurrences take the one that starts last, and return the (up to) ``k``
tokens after it, as plain ints. No ``n`` matches: ``[]``. So ``[1, 2, 3, 4, 1, 2]`` with
``k = 3`` drafts ``[3, 4, 1]``, and ``[7, 7]`` drafts ``[7]``.
""",
            hints=(
                "numpy's `sliding_window_view(tokens[:-1], n)` gives every window of `n` tokens that ends "
                "before the last one; `(windows == tokens[-n:]).all(axis=1)` marks the matches.",
                "`np.flatnonzero(mask)[-1]` is the latest start; the drafts begin `n` tokens after it.",
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
            spec="""
Quantize a float weight ``[N, K]`` to 4-bit codes in groups of ``GROUP_SIZE`` (32) along ``K``,
the layout of a GGUF Q4_1 block.

Reshape the weight (as float32) to ``[N, K // 32, 32]``. Each group maps its own ``[min, max]``
onto the 16 codes: ``scale = (max - min) / 15`` (a constant group, scale 0, takes scale 1 so
every code is 0), ``code = round((w - min) / scale)`` clamped to ``0..15``. The codes are stored
as ``uint8`` ``[N, K]``. The kernel reads a weight back as ``(code - 8) * scale + zero``, so the
stored ``zero`` is ``min + 8 * scale``. Return ``cls(codes, scale, zero)``, scale and zero
``[N, K // 32]``. Every weight then reads back within half a scale of its value.
""",
            hints=(
                "`groups.amin(-1)` and `groups.amax(-1)` give each group's bounds; broadcast them back with "
                "`[..., None]`.",
                "`torch.where(scale > 0, scale, torch.ones_like(scale))` keeps a flat group from dividing by zero.",
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
            spec="""
Add every adapter's LoRA delta to this layer's output ``out`` at once, for a step whose tokens use
several adapters (``self.mapping`` has one segment per adapter slot in use).

The slots' weights are stacked: ``self.stacked_a [slots, R, in]`` and ``self.stacked_b
[slots, R, out]`` (``R`` = slices x max rank; a smaller adapter is zero-padded). The mapping
gives ``slots`` (the slot of each segment, ascending), ``padded_rows`` (each segment's token
rows, padded to one length by repeating a row) and ``padded_scaling [segments, rows, 1]`` (the
slot's ``alpha / r``, 0 on the padding, so a repeated row adds nothing). Take the segments' A
and B (when the segments are every slot, in order, the stacks themselves: no gather), gather the
rows of ``x`` into ``[segments, rows, in]``, and compute ``(x A^T) B`` per segment with two
batched products, times the scaling. Add the result back to ``out``'s rows with one
``index_add_`` (a padding row adds zeros). The tests compare every request's greedy tokens, with
adapters and the base model mixed in one batch, against peft's.
""",
            hints=(
                "`tensor.index_select(0, rows)` gathers; `.view(num_segments, -1, x.shape[1])` makes the batch.",
                "`torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b)` is the shrink then the expand.",
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
            spec="""
One vector per prompt from an encoder's final hidden states ``hidden [batch, seq, dim]``, the
prompts right-padded to ``seq``, ``lengths [batch]`` their true lengths.

By ``self.config.pooling_type``: ``"CLS"`` takes each prompt's first row; ``"LAST"`` its last
real row (``lengths - 1``); ``"MEAN"`` (all-MiniLM-L6-v2's) the mean of its real rows only: a
mask of ``position < length`` in the hidden states' dtype, the masked sum over ``seq`` divided by
the mask's sum (clamped below at ``1e-9``, as sentence-transformers divides). Return
``self.finish(pooled)``, which normalizes when the checkpoint asks for it. The tests compare the
embeddings of the real all-MiniLM-L6-v2 with sentence-transformers', batched (padding present)
and one at a time.
""",
            hints=(
                "`torch.arange(seq)[None, :] < lengths[:, None]` is the `[batch, seq]` mask; "
                "`.unsqueeze(-1)` lets it multiply the hidden states.",
                "Padding rows are not zeros: leaving them out of the mean is the whole point of the mask.",
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
            spec="""
The step as decodes, so that the compiled graph, which attends one query row per sequence, can run
a step whose requests bring several tokens (a speculative verify step, a short prompt).

Token ``i`` of the step becomes row ``i`` of the returned ``PagedAttentionMetadata``: it keeps its
slot (``slot_mapping`` unchanged), reads its own request's block table (the request's row of
``meta.block_tables``, repeated once for each of the request's tokens), and sees ``p + 1`` tokens,
``p`` its position (``seq_lens`` is ``positions + 1``, int32). Every row is a query of one:
``query_start_loc`` is ``0, 1, ..., T`` (int32) and ``max_query_len`` is 1; ``max_seq_len`` stays.
The attention operator writes all rows' K/V before any row attends, so row ``i`` sees the tokens
of its request scheduled before it in the same step: the causal mask, without a mask. The tests
compare the operator on these rows with the reference causal attention, and run verify steps and
a short prompt through the compiled graph, logprob-close to the eager forward.
""",
            hints=(
                "A request's number of tokens this step is `meta.query_start_loc.diff()`.",
                "`meta.block_tables.repeat_interleave(query_lens, dim=0)` gives each token its request's row.",
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
            spec="""
The identity of an image for the prefix cache: a hex SHA-256 digest of the PIL image's mode,
size and pixel bytes (``f"{image.mode}:{image.width}x{image.height}:"`` encoded, then
``image.tobytes()``). The same picture hashes the same whether it came from a file, a data URL
or a URL; one changed pixel changes the hash. The hash joins the keys of the KV blocks that hold
the image's placeholders, so the same text with another image shares no block after the image
starts.
""",
            hints=(
                "`hashlib.sha256()`, then `.update(...)` twice and `.hexdigest()`.",
            ),
            tests=(
                "tests/stage5/test_multimodal.py::test_an_image_hashes_by_its_mode_size_and_pixels_however_it_arrives",
            ),
        ),
        Task(
            name="image_placeholders",
            file="stage5_server/multimodal/processor.py",
            functions=("ImageProcessor.process",),
            spec="""
A prompt's token ids, with one image token (``self.image_token_id``) per image, become the ids
the model runs, with each image token replaced by ``self.num_image_tokens`` placeholders (one
per feature vector the vision tower writes there: for the tiny LLaVA, (40 / 8)^2 = 25 patches),
and one ``MultiModalFeature`` per image.

First count the image tokens: a count other than ``len(images)`` is a ``ValueError`` that says
``"the prompt has N image placeholder(s) for M image(s)"``. Then walk the tokens: any other token
is copied; the i-th image token takes ``images[i]`` converted to RGB, its pixels from the Hugging
Face processor (``self.hf(images=[image], return_tensors="pt", **(processor_kwargs or {}))
["pixel_values"][0]``; a ``TypeError`` or ``ValueError`` there becomes a ``ValueError`` naming
``mm_processor_kwargs``), and a feature
``MultiModalFeature.from_pixels(hash_image(image), offset, self.num_image_tokens, pixels)`` whose
offset is where its placeholders start in the expanded ids; then the placeholders. Return
``(expanded, features)``.
""",
            hints=(
                "The offset is `len(expanded)` just before the placeholders are appended.",
                "The tests compare greedy tokens with transformers' LLaVA, an image mid-prompt included.",
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
            spec="""
One step of an engine whose model is split into ``P`` pipeline stages: keep up to
``self.max_batches_in_flight`` (``P``) batches in flight, so that each stage works on a different
batch.

- If the queue (``self.batch_queue``) has room, schedule (``self.schedule()``). A batch with
  scheduled tokens is sent with ``self.model_executor.execute_model_async(output)`` (a pending
  result); if sending raises, raise ``StepFailed(scheduler.step_failed(output), exc)``. Append
  ``(output, pending)`` to the queue, add the batch's request ids
  (``output.num_scheduled_tokens``) to ``scheduler.in_flight`` (the scheduler skips them until
  their tokens are back) and raise ``self.most_batches_in_flight`` to the queue's length if it is
  deeper. If there is still room, return ``self.finished_outside_step()``: schedule the next
  batch before waiting for any.
- If the queue is empty, return ``self.finished_outside_step()``.
- Otherwise pop the oldest batch, take its ids out of ``scheduler.in_flight``, wait for
  ``pending.result()`` (a failure: ``StepFailed`` as above) and return
  ``self.update(output, result)``.
""",
            hints=(
                "`set.update` and `set.difference_update` take the dict of scheduled tokens (its keys).",
                "The oldest batch is `queue.popleft()`: the stages finish batches in the order they were sent.",
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
            spec="""
The offload tier's answer to a prefix lookup: how many tokens past the local hit it can supply.

``block_hashes`` are the request's full-block hashes (as far as a hit may reach), and
``num_computed_tokens`` the local hit (whole blocks). Starting at the block after the hit
(``num_computed_tokens // self.block_size``), count the run of hashes the tier holds (keys of
``self.slot_of``), stopping at the first it lacks: a block is useful only if every block before
it is there too. Remember those hashes in ``self.matched[request.request_id]`` (in order:
``update_state_after_alloc`` pairs them with the blocks the pool gives them), and return the
count times ``self.block_size``. Nothing else changes: the LRU order moves only when the blocks
are really loaded.
""",
            hints=(
                "`stored_run` (`kv_transfer/base.py`) walks `block_hashes` from a block on and stops at the first "
                "hash its test rejects; `self.slot_of.__contains__` is the test.",
                "Store the list even when it is empty: the pairing step pops it.",
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
