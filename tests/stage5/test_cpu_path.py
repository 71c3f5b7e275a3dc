"""stage5's CPU defaults: threads, the dtype ``auto`` picks, and bfloat16 checked the way vLLM
checks it. (The opt-in compiled forward takes minutes to compile, too long for this suite; the
cpu_roofline benchmark checks its tokens.)"""

from __future__ import annotations

import logging

import pytest
import torch

from shared import ModelConfig, SamplingParams
from shared.closeness import as_token_logprobs, first_divergences
from stage5_server import LLM
from stage5_server.config import CPU_BF16_MIN_HIDDEN_SIZE, cpu_auto_dtype, cpu_has_native_bf16
from stage5_server.core.cpu_threads import configure_engine_threads, physical_cores
from tests.invariants.prompts import PROMPTS


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_engine_threads_default_to_one_per_physical_core_and_say_so(restore_threads, caplog):
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        line = configure_engine_threads()
    assert torch.get_num_threads() == physical_cores() >= 1
    assert line in caplog.text and "physical cores" in line


def test_the_offline_llm_logs_its_configuration_once(tiny_llama, restore_threads, caplog):
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=8)
    [line] = [r.getMessage() for r in caplog.records if "max_model_len=" in r.getMessage()]
    assert "dtype=torch.float32" in line and "max_model_len=64" in line


def test_engine_threads_follow_an_explicit_count_or_omp_num_threads(restore_threads, monkeypatch):
    configure_engine_threads(1)
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert "OMP_NUM_THREADS" in configure_engine_threads()
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="cpu_threads: must be a positive integer"):
        configure_engine_threads(0)


def test_auto_dtype_is_bfloat16_only_for_wide_models_on_cpus_with_bf16_units(tiny_llama):
    narrow = ModelConfig.from_pretrained(tiny_llama)
    wide = ModelConfig(**{**narrow.__dict__, "hidden_size": CPU_BF16_MIN_HIDDEN_SIZE})
    assert cpu_auto_dtype(narrow) == torch.float32
    assert cpu_auto_dtype(wide) == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


def _generate(model, dtype, **kwargs):

    llm = LLM(model=str(model), device="cpu", dtype=dtype, max_model_len=128, block_size=8,
              max_num_batched_tokens=32, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [as_token_logprobs(o.outputs[0].logprobs) for o in outs]


def test_bfloat16_greedy_output_is_logprob_close_to_float32(tiny_llama):
    """vLLM's check of its bf16 models: where the tokens first differ, each is in the other's top 5."""
    ids32, lps32 = _generate(tiny_llama, "float32")
    ids16, lps16 = _generate(tiny_llama, "bfloat16")
    divergences = first_divergences(ids16, lps16, ids32, lps32)
    assert all(d.close for d in divergences), divergences
    assert len(divergences) < len(PROMPTS)  # most prompts agree all the way


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_the_default_model_on_its_own_defaults_is_logprob_close_to_transformers():
    """``LLM()`` with no arguments: bfloat16 on a CPU with bf16 units, and its greedy replies agree with
    transformers' float32 ones on the .gguf file token for token, or diverge only at a near-tie."""
    from tests.invariants.real_model import CHATS, MAX_TOKENS, smollm2_reference

    llm = LLM()
    assert llm.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5), use_tqdm=False)
    reference = smollm2_reference()
    divergences = first_divergences([o.outputs[0].token_ids for o in outs],
                                    [as_token_logprobs(o.outputs[0].logprobs) for o in outs],
                                    [r.token_ids for r in reference], [r.top_logprobs for r in reference])
    assert all(d.close for d in divergences), divergences
    assert outs[0].outputs[0].text == "The capital of France is Paris."
