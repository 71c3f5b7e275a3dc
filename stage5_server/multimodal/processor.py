"""The front end's half of an image: placeholders expanded, pixels prepared, the image hashed.

A chat template (or the caller) writes one image token (``<image>``) where each image goes. The
decoder will see one embedding per feature vector of the image, so each image token is expanded
to as many placeholder tokens as the vision tower gives features (``(image_size / patch_size)^2``
for CLIP with the class token dropped); the engine later writes the features over those
positions. The pixels come from the checkpoint's own image processor (resize, crop, normalise),
loaded as transformers' ``AutoImageProcessor`` does; an image that its resize would make larger than
``VLLM_MAX_IMAGE_PIXELS`` (an extreme aspect ratio) is refused first (``check_resized_size``). This
all happens before the request reaches the engine, so its length checks and the prefix cache see the
expanded prompt.

Chat messages carry images as content parts; ``split_image_parts`` replaces each with a plain
``{"type": "image"}`` part for the template and returns the images (``load_offline_part``: an
``image_pil`` part's image, or a ``data:`` URL's; the API server first fetches the others under its
media rules, ``load_image_parts``).

vLLM: ``vllm/multimodal/processing.py`` (``BaseMultiModalProcessor``, the prompt updates that
expand placeholders) and ``LlavaMultiModalProcessor`` in ``vllm/model_executor/models/llava.py``;
the content parts in ``vllm/entrypoints/chat_utils.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.config import read_config_json
from stage5_server.config.multimodal import LLAVA_ARCHITECTURE, MultiModalConfig, read_llava_config
from stage5_server.multimodal.image_io import decode_data_url, load_image, max_image_pixels
from stage5_server.multimodal.inputs import MultiModalFeature, hash_image

IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")


class ImageProcessor:
    def __init__(self, model_path: str | Path, config: MultiModalConfig):
        from transformers import AutoImageProcessor

        tower = config.vision_config
        self.image_token_id: int = config.image_token_index
        self.num_image_tokens = (tower["image_size"] // tower["patch_size"]) ** 2 + \
            (1 if config.vision_feature_select_strategy == "full" else 0)
        self.hf = AutoImageProcessor.from_pretrained(str(model_path))

    @classmethod
    def for_model(cls, model_path: str | Path) -> ImageProcessor | None:
        """The processor of a vision-language checkpoint; None for any other model."""
        try:
            raw = read_config_json(model_path)
        except ValueError:  # not a Hugging Face directory
            return None
        if LLAVA_ARCHITECTURE not in (raw.get("architectures") or []):
            return None
        return cls(model_path, read_llava_config(raw, model_path)[1])

    def expand(self, token_ids: list[int]) -> list[int]:
        """Each image token as its placeholders (what ``/tokenize`` shows; no image needed)."""
        return [t for token in token_ids for t in
                ([token] * self.num_image_tokens if token == self.image_token_id else [token])]

    def check_resized_size(self, width: int, height: int, processor_kwargs: dict | None = None) -> None:
        """Refuse an image that the resize would blow up past ``VLLM_MAX_IMAGE_PIXELS``: a shortest-edge resize
        keeps the aspect ratio, so a 2 x 1000000 strip (a few kilobytes of PNG, under the pixel limit)
        would become gigabytes of floats at a shortest edge of 40, and far more at CLIP's 336."""
        limit = max_image_pixels()
        size = (processor_kwargs or {}).get("size", getattr(self.hf, "size", None))
        edge = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
        if limit <= 0 or not isinstance(edge, int) or isinstance(edge, bool) or edge < 1:
            return  # a fixed-size resize, or none
        short, long = sorted((width, height))
        resized = edge * -(-edge * long // short)
        if resized > limit:
            raise ValueError(f"image_url: the image is {width}x{height}; this model's image processor resizes its "
                             f"shortest edge to {edge}, which would make {resized} pixels, over the limit of {limit} "
                             "(VLLM_MAX_IMAGE_PIXELS); send an image of a less extreme aspect ratio")

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
            self.check_resized_size(image.width, image.height, processor_kwargs)
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


def load_image_parts(messages: list[dict], load: Callable[[dict], Any]) -> list[dict]:
    """The messages with each image part as ``{"type": "image_pil", "image_pil": load(part)}``."""
    return [message if not isinstance(message.get("content"), list) else
            {**message, "content": [{"type": "image_pil", "image_pil": load(part)}
                                    if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES else part
                                    for part in message["content"]]}
            for message in messages]


def load_offline_part(part: dict):
    """An image content part's image: an ``image_pil`` part's, or an ``image_url`` part's ``data:`` URL decoded
    (fetching a remote URL is the API server's, under its media rules)."""
    if part.get("type") == "image_pil":
        return part["image_pil"]
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError("messages: an image part is an image_pil or an image_url with a data: URL here "
                         "(the API server fetches http(s) URLs)")
    return load_image(decode_data_url(url))


def count_image_parts(messages: list[dict]) -> int:
    return sum(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def has_image_parts(messages: list[dict]) -> bool:
    return count_image_parts(messages) > 0
