"""The front end's half of an image: placeholders expanded, pixels prepared, the image hashed.

A chat template (or the caller) writes one image token (``<image>``) where each image goes. The
decoder will see one embedding per feature vector of the image, so each image token is expanded
to as many placeholder tokens as the vision tower gives features (``(image_size / patch_size)^2``
for CLIP with the class token dropped); the engine later writes the features over those
positions. The pixels come from the checkpoint's own image processor (resize, crop, normalise),
loaded as transformers' ``AutoImageProcessor`` does. This all happens before the request reaches
the engine, so its length checks and the prefix cache see the expanded prompt.

Chat messages carry images as content parts; ``split_image_parts`` replaces each with a plain
``{"type": "image"}`` part for the template and returns the images, loaded by the caller's
``load`` (the API server's media connector, or the offline API's).

vLLM: ``vllm/multimodal/processing.py`` (``BaseMultiModalProcessor``, the prompt updates that
expand placeholders) and ``LlavaMultiModalProcessor`` in ``vllm/model_executor/models/llava.py``;
the content parts in ``vllm/entrypoints/chat_utils.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.config import ModelConfig
from stage5_server.multimodal.inputs import MultiModalFeature, hash_image

IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")


class ImageProcessor:
    def __init__(self, model_path: str | Path, config: ModelConfig):
        from transformers import AutoImageProcessor

        vision = config.vision
        tower = vision["vision_config"]
        self.image_token_id: int = vision["image_token_index"]
        self.num_image_tokens = (tower["image_size"] // tower["patch_size"]) ** 2 + \
            (1 if vision["vision_feature_select_strategy"] == "full" else 0)
        self.hf = AutoImageProcessor.from_pretrained(str(model_path))

    @classmethod
    def for_model(cls, model_path: str | Path) -> ImageProcessor | None:
        """The processor of a vision-language checkpoint; None for any other model."""
        try:
            config = ModelConfig.from_pretrained(model_path)
        except ValueError:  # not a Hugging Face directory this project reads (it generates text only)
            return None
        return None if config.vision is None else cls(model_path, config)

    def expand(self, token_ids: list[int]) -> list[int]:
        """Each image token as its placeholders (what ``/tokenize`` shows; no image needed)."""
        return [t for token in token_ids for t in
                ([token] * self.num_image_tokens if token == self.image_token_id else [token])]

    def process(self, token_ids: list[int], images: list, processor_kwargs: dict | None = None
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """``token_ids`` with one image token per image -> the expanded ids and one feature per image.
        ``processor_kwargs``: the image processor's keyword arguments (a trusted request's)."""
        found = token_ids.count(self.image_token_id)
        if found != len(images):
            raise ValueError(f"multi_modal_data: the prompt has {found} image placeholder(s) for "
                             f"{len(images)} image(s); write one image token per image")
        expanded: list[int] = []
        features = []
        for token in token_ids:
            if token != self.image_token_id:
                expanded.append(token)
                continue
            image = images[len(features)].convert("RGB")
            try:
                pixels = self.hf(images=[image], return_tensors="pt", **(processor_kwargs or {}))["pixel_values"][0]
            except (TypeError, ValueError) as exc:
                raise ValueError(f"mm_processor_kwargs: the image processor refused them ({exc})") from None
            features.append(MultiModalFeature.from_pixels(hash_image(image), len(expanded), self.num_image_tokens,
                                                          pixels))
            expanded += [self.image_token_id] * self.num_image_tokens
        return expanded, features


def images_of(multi_modal_data: Any) -> list:
    """``{"image": image or [images]}`` (vLLM's offline form) -> the list of PIL images."""
    from PIL import Image

    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        raise ValueError("multi_modal_data: expected {'image': a PIL image or a list of them}")
    images = multi_modal_data.get("image", [])
    images = images if isinstance(images, list) else [images]
    for image in images:
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data: images must be PIL images, got {type(image).__name__}")
    return images


def split_image_parts(messages: list[dict], load: Callable[[dict], Any]) -> tuple[list[dict], list]:
    """Each image content part -> ``{"type": "image"}`` (what the chat template renders as the image
    token), and the images ``load(part)`` returns, in order of appearance."""
    images: list = []
    rendered = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                images.append(load(part))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, images


def count_image_parts(messages: list[dict]) -> int:
    return sum(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def has_image_parts(messages: list[dict]) -> bool:
    return count_image_parts(messages) > 0
