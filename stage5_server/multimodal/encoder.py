"""The workers' half of an image: its features, computed once, written over its placeholders.

Each step the runner asks which scheduled positions are image placeholders. For each image whose
span ``[offset, offset + length)`` overlaps the positions a request computes this step, the vision
tower and projector run on its pixels (once: the features stay in a per-request cache) and the
overlapping rows of the features replace the token embeddings at those positions; the decoder
then runs on these embeddings as on any others.

Chunked prefill may split an image's span: a chunk that ends mid-image takes the first rows of
the features, the next chunk the rest, from the cache. An image's features are dropped as soon as
its whole span has been computed (its K/V are in the cache then, and a decode never reads them),
and with the request when it finishes or is preempted (a recompute computes them again).

vLLM: ``_execute_mm_encoder`` and ``_gather_mm_embeddings`` in ``vllm/v1/worker/gpu_model_runner.py``,
with the encoder cache of ``vllm/v1/core/encoder_cache_manager.py``; there the scheduler also
budgets encoder work per step, which this runner does not.
"""

from __future__ import annotations

import torch

from stage5_server.multimodal.inputs import MultiModalFeature
from stage5_server.multimodal.vision import LlavaVision


class MultiModalEmbedder:
    def __init__(self, vision: LlavaVision, device: torch.device, dtype: torch.dtype):
        self.vision, self.device, self.dtype = vision, device, dtype
        self.features: dict[tuple[str, int], torch.Tensor] = {}  # (request id, image index) -> [length, hidden]
        self.num_images_encoded = 0  # a count the tests read: each image once per request

    def forget(self, request_ids) -> None:
        gone = set(request_ids)
        for key in [key for key in self.features if key[0] in gone]:
            del self.features[key]

    def inputs_embeds(self, embed_tokens, input_ids: torch.Tensor, states, num_scheduled: list[int]
                      ) -> torch.Tensor | None:
        """The step's input embeddings with image features at their placeholders, or None when the
        step computes no placeholder position (the model then embeds the token ids itself)."""
        spans: list[tuple[tuple[str, int], MultiModalFeature, int, int, int]] = []
        row = 0
        for state, count in zip(states, num_scheduled):
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            for index, feature in enumerate(state.mm_features):
                if feature.overlaps(start, end):
                    lo, hi = max(start, feature.offset), min(end, feature.end)
                    spans.append(((state.request_id, index), feature, row + lo - start, lo, hi))
            row += count
        if not spans:
            return None
        self._encode([(key, feature) for key, feature, *_ in spans if key not in self.features])
        with torch.inference_mode():
            embeds = embed_tokens(input_ids)
            for key, feature, first_row, lo, hi in spans:
                rows = self.features[key][lo - feature.offset:hi - feature.offset]
                embeds[first_row:first_row + hi - lo] = rows.to(embeds.dtype)
                if hi == feature.end:  # the span is complete: its K/V are cached from now on
                    del self.features[key]
        return embeds

    def _encode(self, missing: list[tuple[tuple[str, int], MultiModalFeature]]) -> None:
        """Run the vision tower once over every image that has no features yet (one batch per pixel shape)."""
        by_shape: dict[tuple[int, ...], list[tuple[tuple[str, int], MultiModalFeature]]] = {}
        for key, feature in missing:
            by_shape.setdefault(feature.shape, []).append((key, feature))
        for group in by_shape.values():
            pixels = torch.stack([feature.pixels() for _, feature in group]).to(self.device, self.dtype)
            for (key, feature), features in zip(group, self.vision(pixels)):
                if features.shape[0] != feature.length:
                    raise ValueError(f"multi_modal_data: an image gives {features.shape[0]} features for "
                                     f"{feature.length} placeholders")
                self.features[key] = features
            self.num_images_encoded += len(group)
