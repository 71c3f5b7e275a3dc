"""The model's shape, read from a Hugging Face ``config.json``.

One dataclass covers the three supported families; the differences between them are
flags (``attention_bias`` for Qwen2, ``qk_norm`` for Qwen3) rather than subclasses.
``from_dict`` reads the fields from a config's dict, for a later stage whose checkpoints
nest a decoder's config inside their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        raw = read_config_json(path)
        archs = raw.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise ValueError(f"model: unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        return cls.from_dict(raw, family)

    @classmethod
    def from_dict(cls, raw: dict, family: str) -> ModelConfig:
        # transformers 5 nests rope settings in "rope_parameters"; 4.x keeps them flat.
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling") or None
        if rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or raw.get("attention_bias", False),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def read_config_json(path: str | Path) -> dict:
    """A checkpoint directory's ``config.json``, as a dict."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: no config.json in {path!s}")
    return json.loads(config_file.read_text())
