"""The transformers reference on the real default model (SmolLM2-135M-Instruct), computed once per process.

transformers loads the ``.gguf`` file itself (``gguf_file=``, its own dequantization and q/k
un-permutation), so agreeing with it checks this project's converter as well as its engines. Each
reply also records the smallest gap between the top two logits over its steps: a comparison
across implementations is only fair where that gap is far above float32 rounding (~1e-4 here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."},
     {"role": "user", "content": "And of Italy?"}],
]
MAX_TOKENS = 16
MIN_MARGIN = 0.02  # logits; two float32 implementations of this model differ by about 1e-4


@dataclass(frozen=True)
class Reply:
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # up to and including EOS, at most MAX_TOKENS
    min_margin: float  # the smallest top-1 minus top-2 logit over the reply's steps
    top_logprobs: tuple[dict[int, float], ...]  # per step, the 5 most likely tokens' logprobs


@functools.cache
def smollm2_reference() -> tuple[Reply, ...]:
    import torch
    from transformers import AutoModelForCausalLM

    from shared import Tokenizer, default_model
    from shared.named_models import default_model_file

    path = default_model_file()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = Tokenizer(default_model())
    eos = model.generation_config.eos_token_id
    replies = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat)
        prompt = torch.tensor([ids])
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):].tolist()
        tokens = tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
        margins = [(lambda top: (top[0] - top[1]).item())(step[0].topk(2).values) for step in out.logits]
        top = [step[0].float().log_softmax(-1).topk(5) for step in out.logits[:len(tokens)]]
        top_logprobs = tuple(dict(zip(t.indices.tolist(), t.values.tolist())) for t in top)
        replies.append(Reply(tuple(ids), tuple(tokens), min(margins[:len(tokens)]), top_logprobs))
    return tuple(replies)
