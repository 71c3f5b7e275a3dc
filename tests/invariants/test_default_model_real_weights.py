"""The real default model, SmolLM2-135M-Instruct: ``LLM()`` with no arguments starts on it in every
stage, and every stage's greedy replies are transformers' own on the ``.gguf`` file, token for token."""

from __future__ import annotations

import pytest

from shared import SamplingParams, default_model
from tests.invariants.real_model import CHATS, MAX_TOKENS, MIN_MARGIN, smollm2_reference

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]


def test_no_argument_llm_serves_the_default_model_with_transformers_tokens(stage):
    reference = smollm2_reference()
    assert all(reply.min_margin >= MIN_MARGIN for reply in reference), [r.min_margin for r in reference]
    # No arguments but stage 5's dtype: there "auto" is bfloat16 where the CPU has native bf16 units (and on a
    # GPU), and the invariant is stated in float32; tests/stage5/test_cpu_path.py checks stage 5's own default.
    llm = stage.module.LLM(**({"device": "cpu", "dtype": "float32"} if stage.number == 5 else {}))
    assert llm.model_path == default_model() and llm.model_config.num_hidden_layers == 30
    assert llm.max_model_len == 8192  # the model's own context fits the automatically sized KV cache
    outputs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for chat, out, want in zip(CHATS, outputs, reference):
        assert tuple(out.prompt_token_ids) == want.prompt_token_ids
        assert tuple(out.outputs[0].token_ids) == want.token_ids, (chat[-1]["content"], out.outputs[0].text)
    assert outputs[0].outputs[0].text == "The capital of France is Paris."
    assert outputs[0].outputs[0].finish_reason == "stop"
