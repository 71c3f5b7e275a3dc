"""Multimodal input: images in a prompt, for a LLaVA-style vision-language model.

The front end expands each image token to one placeholder per feature vector, prepares the
pixels and hashes the image (``processor.py``, ``inputs.py``); the KV cache manager puts that hash
into the prefix-cache key of the blocks the placeholders overlap (``kv_cache.py``); the workers
run the vision tower and projector once per image (``vision.py``) and write the features over the
placeholders' embeddings during prefill (``encoder.py``). Loading an image from a URL is the API
server's job, with its security rules (``server/media.py``).

vLLM: ``vllm/multimodal/`` and ``vllm/model_executor/models/llava.py``.
"""
