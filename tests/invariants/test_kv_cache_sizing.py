"""Default flags start: on CPU the KV cache is sized from the memory that is free, and when one
``max_model_len`` sequence does not fit, ``max_model_len`` comes down to what does (with a warning
naming both flags) rather than the engine refusing to start; sizes the user gave stay strict."""

from __future__ import annotations

import logging

import pytest

from shared import SamplingParams, kv_bytes_per_token
from shared.llm_base import CPU_KV_CACHE_MEMORY, FREE_MEMORY_FRACTION

POOL_ARG = {1: "num_kv_slots"}  # stages 2-5: num_kv_blocks


def build(stage, model, **kwargs):
    """The stage's LLM with the suite's engine arguments but no ``max_model_len`` unless given."""
    if (stage.engine_kwargs.get("speculative_config") or {}).get("method") == "draft_model":
        pytest.skip("a draft model's KV shares the pool: its sizing is tests/stage5/test_draft_model.py's")
    return stage.module.LLM(model=str(model), max_num_seqs=4, **{**stage.engine_kwargs, **kwargs})


def test_automatic_kv_cache_holds_max_num_seqs_full_length_sequences(stage, tiny_llama):
    llm = build(stage, tiny_llama, max_model_len=256)
    per_token = kv_bytes_per_token(llm.model_config, llm.dtype)
    assert 4 * 256 * per_token < min(CPU_KV_CACHE_MEMORY, FREE_MEMORY_FRACTION * 2**30)  # memory is not the limit
    assert llm.kv_cache_capacity == 4 * 256 and llm.max_model_len == 256


def test_max_model_len_comes_down_to_what_free_memory_holds(stage, tiny_llama, monkeypatch, caplog):
    # The tiny model allows 4,096 positions at 1 KiB of K/V a token; pretend 128 KiB are free.
    monkeypatch.setattr("shared.llm_base.available_memory", lambda: 128 << 10)
    with caplog.at_level(logging.WARNING, logger="stagedserve"):
        llm = build(stage, tiny_llama)
    assert kv_bytes_per_token(llm.model_config, llm.dtype) == 1024
    assert llm.max_model_len == llm.kv_cache_capacity == 64  # half of the free memory
    warning = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("max_model_len: lowered"))
    assert "from 4096 to 64" in warning and "--max-model-len" in warning and "--kv-cache-memory" in warning
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("given", ["max_model_len", "kv_cache_memory", "pool"])
def test_sizes_the_user_gave_are_not_changed(stage, tiny_llama, monkeypatch, given):
    monkeypatch.setattr("shared.llm_base.available_memory", lambda: 128 << 10)
    pool_arg = POOL_ARG.get(stage.number, "num_kv_blocks")
    kwargs = {"max_model_len": {"max_model_len": 4096}, "kv_cache_memory": {"kv_cache_memory": 64 << 10},
              "pool": {pool_arg: 16}}[given]
    with pytest.raises(ValueError, match=f"^{pool_arg}: .*max_model_len"):
        build(stage, tiny_llama, **kwargs)
