"""LoRA adapters side by side: each request's tokens are PEFT's own for its adapter, whatever else
shares the batch; the base model's rows stay as without LoRA; the scheduler never needs more slots
than ``max_loras``; the adapter is part of the prefix-cache key; a bad adapter fails at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared import SamplingParams, Tokenizer
from stage3_continuous.config import SchedulerConfig
from stage4_prefix_cache.scheduler import CacheConfig
from stage5_server import LLM, LoRARequest
from stage5_server.core.request import Request
from stage5_server.core.scheduler import Scheduler
from stage5_server.lora import LoRALoadError, load_adapter
from tests.stage5.lora_adapters import make_adapter, peft_greedy

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=16, block_size=4,
              enable_lora=True, max_loras=3)
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = ["Hello, world!", "def add(a, b):", "blocks of a few tokens, found through a table,"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"every": make_adapter(tiny_llama, root / "every", seed=1),
            "q-v": make_adapter(tiny_llama, root / "q-v", seed=2, r=4, alpha=8, target_modules=("q_proj", "v_proj")),
            "mlp": make_adapter(tiny_llama, root / "mlp", seed=3, r=16, alpha=16,
                                target_modules=("gate_proj", "up_proj", "down_proj"))}


def lora_requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def test_each_request_gets_peft_tokens_for_its_adapter_with_adapters_and_base_mixed_in_one_batch(
        tiny_llama, adapters):
    tok = Tokenizer(tiny_llama)
    loras = [None, *lora_requests(adapters).values()]
    prompts = [p for p in PROMPTS for _ in loras]
    per_prompt = [lora for _ in PROMPTS for lora in loras]
    llm = LLM(str(tiny_llama), **ENGINE)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    for prompt, lora, out in zip(prompts, per_prompt, outs):
        adapter = None if lora is None else adapters[lora.lora_name]
        expected = peft_greedy(tiny_llama, adapter, tok.encode(prompt), MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, (prompt, lora)
    by_adapter = {}
    for lora, out in zip(per_prompt, outs):
        by_adapter.setdefault(None if lora is None else lora.lora_name, []).append(out.outputs[0].token_ids)
    assert len({tuple(map(tuple, v)) for v in by_adapter.values()}) == len(loras)  # every adapter changes tokens


def test_base_model_rows_are_bit_identical_to_an_engine_without_lora(tiny_llama, adapters):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    # The same batch shape on both sides (a GEMM's rounding may depend on it), half of it adapted here.
    plain = LLM(str(tiny_llama), **{**ENGINE, "enable_lora": False}).generate(PROMPTS * 2, params, use_tqdm=False)
    every = lora_requests(adapters)["every"]
    mixed = LLM(str(tiny_llama), **ENGINE).generate(PROMPTS * 2, params, use_tqdm=False,
                                                    lora_request=[None] * len(PROMPTS) + [every] * len(PROMPTS))
    for a, b in zip(plain, mixed[:len(PROMPTS)]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the same floats, not merely close


def test_one_slot_serves_three_adapters_in_turn_with_peft_tokens(tiny_llama, adapters):
    tok = Tokenizer(tiny_llama)
    loras = list(lora_requests(adapters).values())
    llm = LLM(str(tiny_llama), **{**ENGINE, "max_loras": 1})
    llm.engine.step_trace = []
    outs = llm.generate([PROMPTS[0]] * 3 + [PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=loras + [None])
    for lora, out in zip(loras, outs):
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama, adapters[lora.lora_name],
                                                       tok.encode(PROMPTS[0]), MAX_TOKENS)
    by_id = dict(zip([o.request_id for o in outs], loras + [None]))
    for step in llm.engine.step_trace:  # one adapter per step, the base model beside it
        assert len({by_id[rid] for rid in step} - {None}) <= 1


def test_the_scheduler_admits_no_more_distinct_adapters_than_max_loras():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), CacheConfig(4, 64),
                          max_model_len=64, max_loras=2)
    loras = [LoRARequest(f"a{i}", i + 1, f"/adapters/a{i}") for i in range(3)]
    plan = [loras[0], loras[1], loras[2], None, loras[0], loras[2]]
    for i, lora in enumerate(plan):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), lora_request=lora))
    first = scheduler.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["r0", "r1", "r3", "r4"]  # a2's wait
    assert {r.lora_request for r in first.scheduled_new_reqs} - {None} == {loras[0], loras[1]}
    scheduler.update_from_output(first, {rid: [7] for rid in first.num_scheduled_tokens})
    while scheduler.has_unfinished_requests():  # each step: every scheduled request gets a token
        output = scheduler.schedule()
        adapters = {scheduler.requests[rid].lora_request for rid in output.num_scheduled_tokens}
        assert len(adapters - {None}) <= 2
        scheduler.update_from_output(output, {rid: [7] for rid in output.num_scheduled_tokens})
    assert not scheduler.requests


def test_the_same_prompt_shares_cached_blocks_under_one_adapter_and_none_across_adapters(tiny_llama, adapters):
    loras = lora_requests(adapters)
    llm = LLM(str(tiny_llama), **{**ENGINE, "enable_prefix_caching": True})
    prompt = "blocks of a few tokens, found through a table, waste at most one partial block"
    params = SamplingParams(temperature=0, max_tokens=1)

    def cached(lora) -> int:
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(loras["every"]) == 0
    assert cached(loras["every"]) > 0  # the same adapter: its blocks again
    assert cached(loras["q-v"]) == 0  # another adapter: none of them
    assert cached(None) == 0  # nor the base model
    renamed = LoRARequest("every", 9, str(adapters["q-v"]))  # the same name from another path
    assert cached(renamed) == 0


def test_an_adapter_above_max_lora_rank_is_refused_at_load_and_nothing_is_queued(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), **{**ENGINE, "max_lora_rank": 8})
    with pytest.raises(ValueError, match="rank 16 is above max_lora_rank=8"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp", 1, str(adapters["mlp"])))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the engine goes on


def test_target_modules_the_model_lacks_are_refused(tiny_llama, adapters, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(adapters["q-v"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["c_attn", "q_proj"]}))
    llm_config = LLM(str(tiny_llama), **ENGINE).model_config
    with pytest.raises(LoRALoadError, match=r"target_modules \['c_attn'\]"):
        load_adapter(bad, llm_config, 16)
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        load_adapter(tmp_path, llm_config, 16)


def test_two_tensor_parallel_ranks_each_holding_their_cut_of_every_adapter_give_peft_tokens(tiny_llama, adapters):
    """q/k/v and gate/up split their outputs (B cut by rows), o and down their inputs (A cut by columns,
    the partial deltas summed by the layer's all-reduce): every adapter and the base model in one batch."""
    tok = Tokenizer(tiny_llama)
    loras = [None, *lora_requests(adapters).values()]
    prompts = [p for p in PROMPTS[:2] for _ in loras]
    per_prompt = [lora for _ in PROMPTS[:2] for lora in loras]
    llm = LLM(str(tiny_llama), **ENGINE, tensor_parallel_size=2, attention_backend="torch")
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    finally:
        llm.shutdown()
    for prompt, lora, out in zip(prompts, per_prompt, outs):
        adapter = None if lora is None else adapters[lora.lora_name]
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama, adapter, tok.encode(prompt), MAX_TOKENS), lora


def test_lora_requests_need_enable_lora_and_lora_is_refused_where_it_does_not_run(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), **{**ENGINE, "enable_lora": False})
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("every", 1, str(adapters["every"])))
    with pytest.raises(ValueError, match="max_loras: must be a positive integer"):
        LLM(str(tiny_llama), **{**ENGINE, "max_loras": 0})
    with pytest.raises(ValueError, match="draft model has no adapters"):
        LLM(str(tiny_llama), **ENGINE, speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="adapters are not split into pipeline stages"):
        LLM(str(tiny_llama), **ENGINE, pipeline_parallel_size=2)


@pytest.mark.slow
def test_the_default_model_gives_peft_tokens_for_two_adapters_and_the_base_in_one_batch(tmp_path):
    from shared import default_model

    base = Path(default_model())
    adapters = {"qv": make_adapter(base, tmp_path / "qv", seed=1, r=8, target_modules=("q_proj", "v_proj"),
                                   scale=0.3),
                "mlp": make_adapter(base, tmp_path / "mlp", seed=2, r=4, alpha=8,
                                    target_modules=("gate_proj", "up_proj", "down_proj"), scale=0.3)}
    tok = Tokenizer(base)
    prompts = ["def fibonacci(n):"]
    loras = [None, *lora_requests(adapters).values()]
    llm = LLM(str(base), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8, enable_lora=True,
              max_loras=2)
    per_prompt = [lora for _ in prompts for lora in loras]
    outs = llm.generate([p for p in prompts for _ in loras], GREEDY, use_tqdm=False, lora_request=per_prompt)
    got = [out.outputs[0].token_ids for out in outs]
    for (prompt, lora), tokens in zip([(p, lora) for p in prompts for lora in loras], got):
        adapter = None if lora is None else adapters[lora.lora_name]
        assert tokens == peft_greedy(base, adapter, tok.encode(prompt), MAX_TOKENS), (prompt, lora)
    assert len({tuple(tokens) for tokens in got}) == 3  # each adapter changes the base model's answer
