"""Load a Hugging Face checkpoint directory (``*.safetensors``, single or sharded) into a model.

A vision-language checkpoint (LLaVA) stores its decoder under ``language_model.`` (or, as newer
transformers write it, ``model.language_model.`` beside a top-level ``lm_head``): that decoder is
loaded here, and the vision tower and projector are left to stage 5 (``stage5_server/multimodal/``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.config import ModelConfig
from shared.model import DecoderModel

logger = logging.getLogger(__name__)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path!s}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"model: weight shard(s) missing from {path!s}: {missing}")
    return files


def decoder_tensor_name(name: str, config: ModelConfig) -> str | None:
    """The decoder parameter a checkpoint tensor fills (``model.`` dropped), or None for a tensor
    of a vision-language checkpoint's vision tower or projector."""
    if config.vision is not None:
        if name.startswith("model.language_model."):  # transformers >= 4.52's layout
            return name.removeprefix("model.language_model.")
        if name.startswith("language_model."):
            return name.removeprefix("language_model.").removeprefix("model.")
        return "lm_head.weight" if name == "lm_head.weight" else None
    return name.removeprefix("model.")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Build the model for ``path``'s config and fill it with the checkpoint's weights."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if config.is_encoder:
        raise ValueError(f"model: {path!s} is an encoder ({config.family}): it pools and cannot generate; "
                         "serve it with stage5_server, whose pooling runner loads it")
    with torch.device("meta"):
        model = DecoderModel(config)
    load_weights(model, config, path, dtype, device)
    logger.info("loaded %s (%s, %d layers) from %s", config.family, dtype, config.num_hidden_layers, path)
    return model.eval(), config


def load_weights(model: DecoderModel, config: ModelConfig, path: str | Path, dtype: torch.dtype,
                 device: str | torch.device, take: Callable[[str, Any], torch.Tensor] | None = None,
                 rename: Callable[[str], str | None] | None = None) -> None:
    """Fill ``model``'s parameters from the checkpoint at ``path``, refusing a tensor with no place
    and a parameter with no tensor. ``take(name, lazy_tensor)`` picks the part of each checkpoint
    tensor that this model holds (a tensor-parallel shard); by default all of it. ``rename(name)``
    gives a tensor's name in this model, or None to pass it by (a pipeline stage holds some layers)."""
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                short = decoder_tensor_name(name, config)
                if short is None:  # a vision-language checkpoint's vision side
                    continue
                if rename is not None and (short := rename(short)) is None:
                    continue
                tied_head = short == "lm_head.weight" and config.tie_word_embeddings
                if "rotary_emb" in short or short.endswith("position_ids") or tied_head:  # derived, not weights
                    continue
                if short not in params:
                    raise ValueError(f"model: checkpoint tensor {name!r} has no place in {config.family} model")
                tensor = take(short, f.get_slice(name)) if take else f.get_tensor(name)
                loaded[short] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(params) - set(loaded) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"model: checkpoint {path!s} lacks tensors {missing[:5]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if hasattr(model, "rotary_emb"):  # an encoder has absolute positions instead
        model.rotary_emb = type(model.rotary_emb)(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
