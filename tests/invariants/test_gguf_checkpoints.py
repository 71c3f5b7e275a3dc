"""A ``.gguf`` file is a checkpoint like any other: every stage loads it (weights, config, tokenizer,
chat template) and gives the same greedy tokens as transformers' own load of that file."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import SamplingParams
from tests.invariants.prompts import PROMPTS, encode_all, hf_greedy
from tests.shared.gguf_files import write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="session")
def llama_q4_1_gguf(tmp_path_factory, tiny_llama) -> Path:
    """The tiny Llama as a Q4_1 file (llama.cpp's converter permutes its q/k rows)."""
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("gguf-checkpoints") / "tiny-llama-Q4_1.gguf", "Q4_1")


def test_gguf_file_gives_the_tokens_of_transformers_gguf_load(stage, llama_q4_1_gguf):
    path = llama_q4_1_gguf
    llm = stage.make_llm(path)
    prompt_ids = encode_all(llm.model_path)
    expected = hf_greedy(path, prompt_ids, GREEDY.max_tokens)
    outputs = llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    for prompt, ids, out, want in zip(PROMPTS, prompt_ids, outputs, expected):
        assert out.prompt_token_ids == list(ids)
        assert out.outputs[0].token_ids == want, prompt


def test_gguf_chat_template_and_stop_token_come_from_the_file(stage, llama_q4_1_gguf):
    llm = stage.make_llm(llama_q4_1_gguf)
    im_end = llm.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert llm.model_config.eos_token_ids == [im_end]
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Add 4 and 5."}])
    assert llm.tokenizer.decode(prompt, skip_special_tokens=False) == \
        "<|im_start|>user\nAdd 4 and 5.<|im_end|>\n<|im_start|>assistant\n"
