"""stage 5's engine core: several tokens per request per step. Draft tokens are scheduled inside the
token budget, verified by the runner, and the rejected ones are rolled back: the request's outputs
and its KV come out as plain decoding gives them."""

from __future__ import annotations

import torch

from shared import SamplingParams
from stage4_prefix_cache import CacheConfig, SchedulerConfig
from stage5_server import LLM, Request
from stage5_server.core import Scheduler

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=4)
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def step_until(llm: LLM, request: Request, num_output_tokens: int) -> None:
    while request.num_output_tokens < num_output_tokens:
        llm.step()


def request_kv(llm: LLM, request_id: str, num_positions: int) -> list[torch.Tensor]:
    """Layer 0's keys and values of a request's first ``num_positions`` positions, read through its block table."""
    cache = llm.engine.model_executor.driver_worker.kv_cache
    blocks = llm.engine.scheduler.kv_cache_manager.get_block_ids(request_id)
    slots = torch.tensor([blocks[p // cache.block_size] * cache.block_size + p % cache.block_size
                          for p in range(num_positions)])
    return [cache.key[0].flatten(0, 1)[slots], cache.value[0].flatten(0, 1)[slots]]


def test_an_accepted_and_a_rejected_draft_give_plain_decodings_tokens_and_kv(tiny_llama):
    expected = LLM(str(tiny_llama), **ENGINE).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(tiny_llama), **ENGINE)
    core = llm.engine
    core.step_trace = []
    request_id = llm.add_request(PROMPT, GREEDY)
    request = core.scheduler.requests[request_id]
    step_until(llm, request, 2)
    n, computed = request.num_output_tokens, request.num_computed_tokens
    wrong = (expected[n + 1] + 1) % 256
    core.scheduler.add_draft_tokens(request, [expected[n], wrong])  # the first is what the model says, the second not
    llm.step()
    assert core.step_trace[-1] == {request_id: 3}  # the last token and two drafts, in one step
    assert request.output_token_ids == expected[:n + 2]  # the accepted draft, then the model's own next token
    assert request.num_computed_tokens == computed + 2  # the rejected draft's position is given back
    assert request.spec_token_ids == []

    n, computed = request.num_output_tokens, request.num_computed_tokens
    core.scheduler.add_draft_tokens(request, [(expected[n] + 1) % 256])  # rejected at once
    llm.step()
    assert core.step_trace[-1] == {request_id: 2}
    assert request.output_token_ids == expected[:n + 1] and request.num_computed_tokens == computed + 1

    plain = LLM(str(tiny_llama), **ENGINE)
    plain_id = plain.add_request(PROMPT, GREEDY)
    plain_request = plain.engine.scheduler.requests[plain_id]
    step_until(plain, plain_request, request.num_output_tokens)
    assert plain_request.num_computed_tokens == request.num_computed_tokens
    for got, want in zip(request_kv(llm, request_id, request.num_computed_tokens),
                         request_kv(plain, plain_id, plain_request.num_computed_tokens)):
        # Equal up to float rounding (a position computed in a 3-token step rather than alone; no stale draft KV).
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    assert finished[0].outputs[0].token_ids == expected


def test_drafts_count_against_the_token_budget_and_roll_back_without_a_model():
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4)
    scheduler = Scheduler(config, CacheConfig(block_size=4, num_blocks=16), max_model_len=64, vocab_size=100)
    a, b = (Request(rid, list(range(first, first + 6)), SamplingParams(max_tokens=20, ignore_eos=True))
            for rid, first in (("a", 1), ("b", 11)))
    for request in (a, b):
        scheduler.add_request(request)
    first = scheduler.schedule()  # 6 + 2 prompt tokens: b's prefill is chunked
    scheduler.update_from_output(first, {"a": [50], "b": []})
    scheduler.add_draft_tokens(a, [51, 52, 53])
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 4, "b": 4}  # a: its last token and three drafts
    assert second.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3  # 10 positions need 3 blocks of 4
    scheduler.update_from_output(second, {"a": [51, 60], "b": [70]})  # one accepted, then a token of its own
    assert a.output_token_ids == [50, 51, 60] and a.num_computed_tokens == 8  # prompt, 50, 51 have KV
    assert b.output_token_ids == [70] and b.num_computed_tokens == 6

    scheduler.add_draft_tokens(a, [61, 62, 63, 64, 65, 66, 67, 68])
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 8}  # the budget cuts the drafts to 7 (and leaves b none)
    assert third.scheduled_spec_decode_tokens == {"a": [61, 62, 63, 64, 65, 66, 67]}
