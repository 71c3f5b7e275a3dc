"""A LLaVA-style checkpoint's config: its text decoder's shape, and the settings of the vision side.

A vision-language checkpoint nests its decoder's config under ``text_config``; the rest says how the
vision tower and the projector in front of the decoder are built and where an image goes in the
prompt (``image_token_index``). ``read_llava_config`` splits the two: the decoder's ``ModelConfig``
(what every stage reads) and a ``MultiModalConfig`` (what only the multimodal room reads).

vLLM: ``MultiModalConfig`` in ``vllm/config/multimodal.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.config import ModelConfig

LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
TEXT_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class MultiModalConfig:
    vision_config: dict  # the vision tower's, as the checkpoint wrote it (CLIP)
    image_token_index: int  # the prompt token that stands for an image
    vision_feature_layer: int
    vision_feature_select_strategy: str  # "default": drop the class token; "full": keep it
    projector_hidden_act: str
    multimodal_projector_bias: bool


def read_llava_config(raw: dict, path: str | Path) -> tuple[ModelConfig, MultiModalConfig]:
    """The decoder's shape from ``text_config``, and the vision side."""
    text = dict(raw.get("text_config") or {})
    family = text.get("model_type", "llama")
    if family not in TEXT_MODEL_TYPES:
        raise ValueError(f"model: {path!s}: unsupported text model {family!r} (supported: {sorted(TEXT_MODEL_TYPES)})")
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    if text.get("eos_token_id") is None and raw.get("eos_token_id") is not None:
        text["eos_token_id"] = raw["eos_token_id"]
    multimodal = MultiModalConfig(
        vision_config=dict(raw.get("vision_config") or {}),
        image_token_index=raw.get("image_token_index", raw.get("image_token_id")),
        vision_feature_layer=raw.get("vision_feature_layer", -2),
        vision_feature_select_strategy=raw.get("vision_feature_select_strategy", "default"),
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        multimodal_projector_bias=raw.get("multimodal_projector_bias", True))
    return ModelConfig.from_dict(text, family), multimodal
