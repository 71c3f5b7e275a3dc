"""PEFT adapters built in the test, on a checkpoint on disk, with PEFT's own ``get_peft_model``.

PEFT starts ``lora_B`` at zero (an untrained adapter changes nothing), so it is drawn at random
here: an adapter that did not reach the forward pass would then give other tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: Path, out: Path, seed: int, r: int = 8, alpha: int = 16,
                 target_modules=ALL_PROJECTIONS, scale: float = 0.5) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules),
                                                  lora_dropout=0.0))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(out)
    return out


@functools.cache
def peft_model(base: Path, adapter: Path | None):
    """transformers' model with PEFT's adapter on top (``adapter`` None: the base model), float32, no EOS."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def peft_greedy(base: Path, adapter: Path | None, ids: list[int], max_new_tokens: int) -> list[int]:
    model = peft_model(base, adapter)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()
