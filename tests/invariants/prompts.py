"""Prompts and the Hugging Face reference outputs the invariant suite compares against."""

from __future__ import annotations

import functools
from pathlib import Path

# Ragged on purpose: 1 token up to a few dozen, including multi-byte characters.
PROMPTS = [
    "Hello, world!",
    "A scheduler spends one token budget per step: running requests decode first,",
    "x",
    "Café 東京 🙂 blocks of a few tokens, found through a table, waste at most one partial block.",
    "def add(a, b):",
]


@functools.cache
def hf_model(model_path: Path):
    """transformers' own model for this checkpoint, in float32; a ``.gguf`` file is loaded by
    transformers itself (``gguf_file=``)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent if kwargs else path, dtype=torch.float32,
                                                 **kwargs).eval()
    # Never stop on EOS and never suppress it (``min_new_tokens`` would mask its logit).
    model.generation_config.eos_token_id = None
    return model


@functools.cache
def hf_greedy(model_path: Path, prompt_ids: tuple[tuple[int, ...], ...], max_new_tokens: int):
    """Token ids from transformers' own ``generate`` (greedy, EOS ignored), one prompt at a time."""
    return [hf_generate(model_path, ids, max_new_tokens) for ids in prompt_ids]


def hf_generate(model_path: Path, ids, max_new_tokens: int, logits_processors=(), eos_token_id=None) -> list[int]:
    """One prompt through transformers' greedy ``generate`` with these logits processors, in this
    order; it stops at ``eos_token_id`` when one is given, else runs ``max_new_tokens``."""
    import torch
    from transformers import LogitsProcessorList

    model = hf_model(model_path)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         logits_processor=LogitsProcessorList(logits_processors), eos_token_id=eos_token_id,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_prompt_logprobs(model_path: Path, ids):
    """``[len(ids) - 1, vocab]``: transformers' log-probabilities of the token after each prompt position."""
    import torch

    with torch.no_grad():
        logits = hf_model(model_path)(torch.tensor([ids])).logits[0, :-1]
    return logits.float().log_softmax(dim=-1)


def encode_all(model_path: Path, prompts=PROMPTS) -> tuple[tuple[int, ...], ...]:
    from shared import Tokenizer

    tok = Tokenizer(model_path)
    return tuple(tuple(tok.encode(p)) for p in prompts)
