"""Bytes -> a PIL image, with the decode-side caps: a ``data:`` URL's payload and the pixel limit.

An image file's header states its size before its pixels are decoded, so a decompression bomb (a
few kilobytes of PNG that inflate to gigapixels) is refused from the header: ``Image.open`` reads
only the header, the width times height is checked against ``VLLM_MAX_IMAGE_PIXELS``, and only
then are the pixels loaded.

vLLM: ``ImageMediaIO`` in ``vllm/multimodal/image.py`` (the same header check) and the ``data:``
branch of ``MediaConnector`` in ``vllm/multimodal/utils.py``. vLLM's default is 178956970 pixels,
twice Pillow's bomb threshold; this server's is 16 megapixels. 0 turns the check off, as in vLLM.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings

DEFAULT_MAX_IMAGE_PIXELS = 16 * 1024 * 1024  # 16 megapixels


def max_image_pixels() -> int:
    return int(os.environ.get("VLLM_MAX_IMAGE_PIXELS", DEFAULT_MAX_IMAGE_PIXELS))


def decode_data_url(url: str) -> bytes:
    """``data:image/png;base64,...`` -> the image's bytes."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise ValueError("image_url: a data URL must read data:<media type>;base64,<data>")
    media_type, _, encoding = header.removeprefix("data:").partition(";")
    if not media_type.startswith("image/"):
        raise ValueError(f"image_url: a data URL of media type {media_type!r} is not an image")
    if encoding != "base64":
        raise ValueError("image_url: only base64 data URLs are supported")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: the data URL's payload is not valid base64") from None


def load_image(data: bytes, max_pixels: int | None = None):
    """The image in ``data`` as RGB, refused before decoding if its header claims more than
    ``max_pixels`` (default: ``VLLM_MAX_IMAGE_PIXELS``)."""
    from PIL import Image, UnidentifiedImageError

    limit = max_image_pixels() if max_pixels is None else max_pixels
    try:
        with warnings.catch_warnings():  # the size is checked just below, at this server's own limit
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as exc:  # Pillow's own, far larger, limit
        raise ValueError(f"image_url: the image is too large ({exc})") from None
    except (UnidentifiedImageError, OSError):
        raise ValueError("image_url: the data is not an image this server can read") from None
    width, height = image.size
    if limit > 0 and width * height > limit:
        raise ValueError(f"image_url: the image is {width}x{height} = {width * height} pixels, over the limit "
                         f"of {limit} (VLLM_MAX_IMAGE_PIXELS)")
    try:
        image.load()
    except (OSError, ValueError) as exc:
        raise ValueError(f"image_url: the image could not be decoded ({exc})") from None
    return image.convert("RGB")
