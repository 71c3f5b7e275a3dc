"""An image as the engine sees it: its pixels, where its placeholder tokens sit, and its hash.

The front end turns each image into a ``MultiModalFeature``: the processor's ``pixel_values``
(float32, as bytes so the struct crosses to an engine process as msgpack), the prompt position of
its first placeholder token (``offset``) and how many there are (``length``), and a hash of the
image's content (``identifier``). The workers compute features from the pixels; the KV cache
manager puts the identifier into the hash of every block the placeholders overlap.

vLLM: ``MultiModalFeatureSpec`` and ``PlaceholderRange`` in ``vllm/multimodal/inputs.py``; the hash
in ``vllm/multimodal/hasher.py`` (``MultiModalHasher``).
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import torch


class MultiModalFeature(msgspec.Struct, frozen=True):
    identifier: str  # the content hash: equal images, equal identifiers
    offset: int  # prompt position of the first placeholder token
    length: int  # placeholder tokens, one per feature vector
    pixel_values: bytes  # float32, C-contiguous, of ``shape``
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its placeholders lies in the positions ``[start, end)``."""
        return self.offset < end and start < self.end

    def pixels(self) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(self.pixel_values, dtype=np.float32).reshape(self.shape).copy())

    @classmethod
    def from_pixels(cls, identifier: str, offset: int, length: int, pixels: torch.Tensor) -> MultiModalFeature:
        array = pixels.detach().to("cpu", torch.float32).contiguous().numpy()
        return cls(identifier, offset, length, array.tobytes(), tuple(array.shape))


def hash_image(image) -> str:
    """SHA-256 of a PIL image's mode, size and pixel bytes: the same picture from a file, a data URL
    or a URL hashes the same; a single changed pixel changes it."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
