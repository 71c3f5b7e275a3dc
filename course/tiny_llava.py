"""A tiny LLaVA-style vision-language checkpoint, for tests and ``stagedserve make-tiny-model --arch llava``.

``LlavaForConditionalGeneration`` over a tiny CLIP vision tower and the tiny Llama decoder of
``course/tiny_model.py``, random weights, with a processor (a ``CLIPImageProcessor`` and the
tokenizer with an ``<image>`` token) that ``AutoProcessor`` loads: an ordinary Hugging Face directory.
"""

from __future__ import annotations

from pathlib import Path

from course.tiny_model import TINY, cached_tiny_model, train_tokenizer, transformers_config

IMAGE_TOKEN = "<image>"
# ChatML whose message content may be a list of parts: text as is, an image as one ``<image>``,
# which the processor expands to the image's feature length.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] or [] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url', 'input_image') %}<image>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A CLIP vision tower of 40x40 pixels in 8x8 patches: 25 image tokens (not a multiple of a block).
TINY_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   image_size=40, patch_size=8, projection_dim=64)


def make_tiny_llava(path: str | Path, seed: int = 0, vocab_size: int = 512, size: dict | None = None) -> Path:
    """A random ``LlavaForConditionalGeneration`` (tiny CLIP tower, tiny Llama decoder) and its processor."""
    import torch
    import transformers

    path = Path(path)
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    text_config, _ = transformers_config("llama", len(tokenizer), eos_ids, size or TINY)
    vision_config = transformers.CLIPVisionConfig(**TINY_VISION)
    config = transformers.LlavaConfig(vision_config=vision_config, text_config=text_config,
                                      image_token_index=image_token_id, vision_feature_layer=-2,
                                      vision_feature_select_strategy="default", eos_token_id=eos_ids)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0]
    side = TINY_VISION["image_size"]
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": side},
                                                      crop_size={"height": side, "width": side})
    # One extra feature (CLIP's class token) that the "default" strategy drops: the processor
    # expands ``<image>`` to (side / patch)^2 tokens, as many as the tower gives.
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                            patch_size=TINY_VISION["patch_size"], num_additional_image_tokens=1,
                                            vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                                            chat_template=VISION_CHAT_TEMPLATE)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cached_tiny_llava(seed: int = 0) -> Path:
    """The tiny LLaVA, built once and cached (``course.tiny_model.cached_tiny_model``)."""
    return cached_tiny_model("llava", seed, make=make_tiny_llava, chat_template=VISION_CHAT_TEMPLATE)
