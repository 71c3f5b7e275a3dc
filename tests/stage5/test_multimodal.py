"""Images in a prompt on a tiny random LLaVA (transformers' ``LlavaForConditionalGeneration``): the
processor's expansion, greedy tokens identical to transformers' ``generate`` in float32 (one image,
two, an image mid-prompt, chunked prefill splitting an image's span), each image encoded once per
request, and the image's hash in the prefix-cache key of exactly the blocks it overlaps."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from shared import SamplingParams
from stage5_server import LLM
from stage5_server.multimodal.inputs import hash_image

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def picture(seed: int, size=(50, 60)):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8))


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_pil", "image_pil": p}
               for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def hf(tiny_llava):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return (AutoProcessor.from_pretrained(tiny_llava),
            LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def llm(tiny_llava):
    return LLM(str(tiny_llava), dtype="float32", device="cpu", attention_backend="torch", block_size=16,
               num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=512)


def reference(hf, messages, max_tokens=10) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens for the conversation."""
    processor, model = hf
    template_messages = [{**m, "content": [{"type": "image"} if p["type"] == "image_pil" else p
                                           for p in m["content"]]} for m in messages]
    text = processor.apply_chat_template(template_messages, add_generation_prompt=True)
    images = [p["image_pil"] for m in messages for p in m["content"] if p["type"] == "image_pil"]
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()


def encoded_images(llm) -> int:
    runs = llm.engine.model_executor.collective_rpc(lambda worker: worker.model_runner.mm_embedder.num_images_encoded)
    return runs[0]


def test_the_tiny_llava_loads_with_auto_processor_and_expands_an_image_to_its_feature_count(tiny_llava, hf):
    processor, model = hf
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    ids = processor(text="look <image> here", images=[picture(0)], return_tensors="pt")["input_ids"][0].tolist()
    assert ids.count(model.config.image_token_index) == 25  # (40 / 8)^2 patches, the class token dropped


@pytest.mark.parametrize("case", ["one image", "two images", "image mid-prompt"])
def test_greedy_tokens_match_transformers(llm, hf, case):
    messages = {"one image": user(picture(1), "What is in this picture?"),
                "two images": user("Compare", picture(2), "with", picture(3), "please."),
                "image mid-prompt": user("A serving engine turns prompts into tokens.", picture(4),
                                         "Describe it in a few words.")}[case]
    prompt_ids, expected = reference(hf, messages)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == expected


def test_generate_takes_multi_modal_data_as_vllm_does(llm, hf):
    image = picture(5)
    text = "<|im_start|>user\nHello <image> what?<|im_end|>\n<|im_start|>assistant\n"
    _, expected = reference(hf, user("Hello ", image, " what?"))
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected


def test_chunked_prefill_splits_an_image_and_encodes_it_once(tiny_llava, hf):
    messages = user("Chunks of a few tokens:", picture(6), "and", picture(7), "end.")
    _, expected = reference(hf, messages)
    small = LLM(str(tiny_llava), dtype="float32", device="cpu", attention_backend="torch", block_size=16,
                num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=8, enable_prefix_caching=False)
    out = small.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected  # every span cut by chunks of 8 positions
    assert encoded_images(small) == 2


def test_an_image_by_data_url_is_the_same_image(llm):
    image = picture(8)
    by_pil = llm.chat(user("Say", image), GREEDY, use_tqdm=False)[0]
    parts = [{"type": "text", "text": "Say"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    by_url = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert by_url.outputs[0].token_ids == by_pil.outputs[0].token_ids


def test_a_placeholder_count_that_does_not_match_the_images_is_refused(llm):
    with pytest.raises(ValueError, match="2 image placeholder"):
        llm.generate({"prompt": "<image><image>", "multi_modal_data": {"image": picture(0)}}, GREEDY)


def test_a_text_only_model_refuses_an_image(tiny_llama):
    text_only = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=256)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate({"prompt": "hi", "multi_modal_data": {"image": picture(0)}}, GREEDY)


# ---- the prefix cache ------------------------------------------------------------------------------

def cached_tokens(llm, messages) -> int:
    before = llm.engine.stats().prefix_cache_hits
    llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return llm.engine.stats().prefix_cache_hits - before


def test_an_image_hashes_by_its_mode_size_and_pixels_however_it_arrives():
    from PIL import Image

    image = picture(3)
    decoded = Image.open(io.BytesIO(base64.b64decode(data_url(image).split(",", 1)[1])))  # as a data URL arrives
    assert hash_image(decoded) == hash_image(image)
    assert len(hash_image(image)) == 64 and int(hash_image(image), 16) >= 0  # a SHA-256, in hex
    changed = image.copy()
    changed.putpixel((0, 0), tuple(255 - v for v in image.getpixel((0, 0))))
    assert hash_image(changed) != hash_image(image)  # one pixel
    assert hash_image(image.convert("RGBA")) != hash_image(image)  # the same pixels in another mode
    flat = Image.new("RGB", (6, 4))
    assert hash_image(flat) != hash_image(flat.resize((4, 6)))  # the same bytes in another shape


def test_same_text_with_another_image_shares_no_block_after_the_image_start(llm):
    text = "A serving engine turns prompts into tokens and schedules them."
    first, second = picture(10), picture(11)
    assert hash_image(first) != hash_image(second)
    llm.reset_prefix_cache()
    rendered = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]
    prefix = llm.tokenizer.apply_chat_template(rendered, True).index(  # where the image starts
        llm.config.multimodal.image_token_index)
    assert prefix >= 16
    cached_tokens(llm, user(text, first, "Describe."))
    assert cached_tokens(llm, user(text, second, "Describe.")) == prefix // 16 * 16  # the text's blocks only
    same = cached_tokens(llm, user(text, first, "Describe."))
    assert same > prefix + 25  # past the image: its hash matched


def test_a_users_text_spelling_the_image_token_stays_text(llm):
    """Placeholders come only from the template: ``<image>`` typed in a message is text, so this
    conversation has one image token for its one image (two would be refused)."""
    out = llm.chat(user("my <image> tag:", picture(9)), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(llm.config.multimodal.image_token_index) == 25


def test_a_prefix_cache_hit_that_ends_inside_an_image_still_matches_transformers(llm, hf):
    """The same text and image, then another question: the cached blocks end inside the image's
    span, so the rest of the span is computed from the image's features, rows from the middle on."""
    text, image = "A serving engine turns prompts into tokens and schedules them.", picture(12)
    llm.reset_prefix_cache()
    llm.chat(user(text, image, "First?"), GREEDY, use_tqdm=False)
    messages = user(text, image, "Second question, longer?")
    prompt_ids, expected = reference(hf, messages)
    start = prompt_ids.index(llm.config.multimodal.image_token_index)
    before = llm.engine.stats().prefix_cache_hits
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    hits = llm.engine.stats().prefix_cache_hits - before
    assert start < hits < start + 25  # the hit stops inside the image's placeholders
    assert out.outputs[0].token_ids == expected


def test_stages_before_five_refuse_images_rather_than_drop_them(tiny_llama):
    from stage4_prefix_cache import LLM as Stage4LLM

    stage4 = Stage4LLM(str(tiny_llama), num_kv_blocks=32, max_model_len=256)
    with pytest.raises(ValueError, match="^multi_modal_data: this engine does not take it"):
        stage4.generate({"prompt": "hi", "multi_modal_data": {"image": picture(0)}}, GREEDY)
