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
def hf_greedy(model_path: Path, prompt_ids: tuple[tuple[int, ...], ...], max_new_tokens: int):
    """Token ids from transformers' own ``generate`` (greedy, EOS ignored), one prompt at a time.
    ``model_path`` may be a ``.gguf`` file: transformers then loads it itself (``gguf_file=``)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent if kwargs else path, dtype=torch.float32,
                                                 **kwargs).eval()
    # Never stop on EOS and never suppress it (``min_new_tokens`` would mask its logit).
    model.generation_config.eos_token_id = None
    results = []
    for ids in prompt_ids:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        results.append(out[0, len(ids):].tolist())
    return results


def encode_all(model_path: Path, prompts=PROMPTS) -> tuple[tuple[int, ...], ...]:
    from shared import Tokenizer

    tok = Tokenizer(model_path)
    return tuple(tuple(tok.encode(p)) for p in prompts)
