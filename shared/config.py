"""The model's shape, read from a Hugging Face ``config.json``.

One dataclass covers the three supported families; the differences between them are
flags (``attention_bias`` for Qwen2, ``qk_norm`` for Qwen3) rather than subclasses.
A LLaVA-style vision-language checkpoint is its text decoder's shape (from ``text_config``)
plus ``vision``: the vision tower's and projector's settings, kept as the checkpoint wrote
them (stage 5 builds the tower, ``stage5_server/multimodal/``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "BertModel": "bert",  # an encoder: pooled, never generating (stage5_server/pooling/)
}
ENCODER_FAMILIES = frozenset({"bert"})
# A vision tower and a projector in front of one of the decoders above (its ``text_config``).
VISION_LANGUAGE_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava"}
TEXT_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3" | "bert"
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
    type_vocab_size: int = 0  # BERT's token-type (segment) embeddings
    hidden_act: str = "silu"
    # A vision-language checkpoint's vision side: model_type, vision_config, image_token_index,
    # vision_feature_layer, vision_feature_select_strategy, projector_hidden_act (None: text only).
    vision: dict | None = None

    @property
    def is_encoder(self) -> bool:
        """Bidirectional attention over the whole input: it pools, it cannot generate."""
        return self.family in ENCODER_FAMILIES

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: no config.json in {path!s}")
        raw = json.loads(config_file.read_text())
        archs = raw.get("architectures") or []
        if any(a in VISION_LANGUAGE_ARCHITECTURES for a in archs):
            return cls._vision_language(raw, path)
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            supported = sorted({*SUPPORTED_ARCHITECTURES, *VISION_LANGUAGE_ARCHITECTURES})
            raise ValueError(f"model: unsupported architecture {archs!r}; supported: {supported}")
        return cls._from_raw(raw, family)

    @classmethod
    def _vision_language(cls, raw: dict, path: str | Path) -> ModelConfig:
        """The text decoder's shape from ``text_config``, the vision side kept in ``vision``."""
        text = dict(raw.get("text_config") or {})
        family = TEXT_MODEL_TYPES.get(text.get("model_type", "llama"))
        if family is None:
            raise ValueError(f"model: {path!s}: unsupported text model {text.get('model_type')!r} "
                             f"(supported: {sorted(TEXT_MODEL_TYPES)})")
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        if text.get("eos_token_id") is None and raw.get("eos_token_id") is not None:
            text["eos_token_id"] = raw["eos_token_id"]
        config = cls._from_raw(text, family)
        config.vision = {
            "model_type": "llava",
            "vision_config": dict(raw.get("vision_config") or {}),
            "image_token_index": raw.get("image_token_index", raw.get("image_token_id")),
            "vision_feature_layer": raw.get("vision_feature_layer", -2),
            "vision_feature_select_strategy": raw.get("vision_feature_select_strategy", "default"),
            "projector_hidden_act": raw.get("projector_hidden_act", "gelu"),
            "multimodal_projector_bias": raw.get("multimodal_projector_bias", True),
        }
        return config

    @classmethod
    def _from_raw(cls, raw: dict, family: str) -> ModelConfig:
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
            rms_norm_eps=raw.get("rms_norm_eps", raw.get("layer_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or raw.get("attention_bias", False),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            type_vocab_size=raw.get("type_vocab_size", 0),
            hidden_act=raw.get("hidden_act", "silu"),
        )
