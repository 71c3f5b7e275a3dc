"""Load a Hugging Face checkpoint directory (``*.safetensors``, single or sharded) into a model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

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


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Build the model for ``path``'s config and fill it with the checkpoint's weights."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DecoderModel(config)
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                short = name.removeprefix("model.")
                if short not in params:
                    if "rotary_emb" in short:
                        continue
                    if short == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    raise ValueError(f"model: checkpoint tensor {name!r} has no place in {config.family} model")
                loaded[short] = f.get_tensor(name).to(device=device, dtype=dtype)
    missing = sorted(set(params) - set(loaded))
    if config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        raise ValueError(f"model: checkpoint {path!s} lacks tensors {missing[:5]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary_emb = type(model.rotary_emb)(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    logger.info("loaded %s (%s, %d layers) from %s", config.family, dtype, config.num_hidden_layers, path)
    return model.eval(), config
