"""Load a Hugging Face checkpoint directory (``*.safetensors``, single or sharded) into a model.

Each checkpoint tensor fills the model parameter of its name, ``model.`` dropped
(``model.layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``). A caller can rename
tensors (``rename``) and take part of each (``take``): a later stage loads one shard or one stage
of a model that way, or the decoder of a checkpoint that holds more than a decoder.
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


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               config: ModelConfig | None = None, rename: Callable[[str], str | None] | None = None):
    """Build the model for ``config`` (default: ``path``'s) and fill it with the checkpoint's weights
    (``rename``: as ``load_weights`` takes it)."""
    path = Path(path)
    config = config or ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DecoderModel(config)
    load_weights(model, config, path, dtype, device, rename=rename)
    logger.info("loaded %s (%s, %d layers) from %s", config.family, dtype, config.num_hidden_layers, path)
    return model.eval(), config


def load_weights(model: DecoderModel, config: ModelConfig, path: str | Path, dtype: torch.dtype,
                 device: str | torch.device, take: Callable[[str, Any], torch.Tensor] | None = None,
                 rename: Callable[[str], str | None] | None = None) -> None:
    """Fill ``model``'s parameters from the checkpoint at ``path``, refusing a tensor with no place
    and a parameter with no tensor. ``take(name, lazy_tensor)`` picks the part of each checkpoint
    tensor that this model holds (a tensor-parallel shard); by default all of it. ``rename(name)``
    gives a tensor's name in this model (``name`` with ``model.`` dropped), or None to pass it by
    (a pipeline stage holds some layers)."""
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                short = name.removeprefix("model.")
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
    if hasattr(model, "rotary_emb"):
        model.rotary_emb = type(model.rotary_emb)(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
