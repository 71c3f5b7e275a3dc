"""The backend registry and the Triton backend end to end (interpreter mode on a CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from shared import SamplingParams
from stage5_server.attention import resolve_attention_backend
from tests.invariants.prompts import PROMPTS


def test_auto_picks_the_cpu_backend_on_a_cpu():
    assert resolve_attention_backend(None, torch.device("cpu")) == "cpu"
    assert resolve_attention_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_attention_backend("torch", torch.device("cpu")) == "torch"


def test_the_cpu_backend_on_another_device_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend: cpu runs on a CPU only"):
        resolve_attention_backend("cpu", torch.device("cuda"))


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="attention_backend: unknown 'flash'"):
        resolve_attention_backend("flash", torch.device("cpu"))


def test_triton_on_a_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_attention_backend("triton", torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs CUDA or TRITON_INTERPRET=1 set before Triton is imported")
def test_triton_backend_gives_the_same_greedy_tokens_as_torch(tiny_llama):
    from stage5_server import LLM

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = PROMPTS[:3]
    kwargs = dict(model=str(tiny_llama), block_size=8, max_model_len=128, max_num_batched_tokens=24, device="cpu")
    triton_llm = LLM(attention_backend="triton", **kwargs)
    assert triton_llm.attention_backend_name == "triton"
    with_triton = triton_llm.generate(prompts, params, use_tqdm=False)
    with_torch = LLM(attention_backend="torch", **kwargs).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in with_triton] == [o.outputs[0].token_ids for o in with_torch]
