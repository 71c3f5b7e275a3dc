"""GGUF weights kept quantized: a llama.cpp file's Q4_0/Q4_1 blocks become int4 linears as they are.

``shared/gguf.py`` dequantizes the file into the checkpoint every stage loads; this reads the
file's blocks again and gives each linear layer of the loaded model its own quantized weight:

- Q4_0 and Q4_1 store 32 weights per block, 4-bit codes ``q`` with an fp16 scale ``d`` (and for
  Q4_1 an fp16 minimum ``m``): ``w = d * (q - 8)`` and ``w = d * q + m``. The int4 kernel reads
  ``(q - 8) * scale + zero`` over groups of 32 along the input dimension, so a block maps onto a
  group exactly: ``scale = d`` and ``zero = 0`` (Q4_0) or ``zero = m + 8 * d`` (Q4_1). The codes
  are the file's; only the scale and zero are rounded to the activations' dtype (bfloat16 keeps
  8 bits of each).
- Q8_0 (int8 codes, one fp16 scale per 32) has no such kernel here: ``_weight_int8pack_mm``
  takes one scale per output row, so a Q8_0 tensor is dequantized and requantized per row, an
  8-bit rounding of 8-bit values. The default model's only Q8_0 tensor is its embedding, which
  its tied LM head shares.
- F32/F16 tensors, and a fused projection whose parts disagree, keep the float weights.

The fused projections (``model/fused.py``) take their parts' blocks row after row, so one
``qkv_proj`` holds the q, k and v blocks; the LM head of a tied model takes the embedding's.

vLLM: ``GGUFLinearMethod`` in ``vllm/model_executor/layers/quantization/gguf.py`` (its CUDA
kernels read the blocks directly) and ``vllm/model_executor/model_loader/gguf_loader.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from shared.gguf import read_raw_tensors
from stage5_server.model.linear import Linear, LinearMethod
from stage5_server.quantization.weight_only import (
    Int4Groups,
    Int4LinearMethod,
    Int8LinearMethod,
    int4_shape_problem,
)

INT4_TYPES = ("Q4_0", "Q4_1")
INT8_TYPES = ("Q8_0",)
BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# A fused projection (model/fused.py) -> its parts, whose rows it stacks in this order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of every block, as float32 ``[rows, blocks]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _blocks(type_name: str, data: np.ndarray) -> np.ndarray:
    rows = data.shape[0]
    if data.dtype != np.uint8 or data.shape[1] % _BLOCK_BYTES[type_name]:
        raise ValueError(f"quantization: a {type_name} tensor's rows are not whole blocks (shape {data.shape})")
    return data.reshape(rows, -1, _BLOCK_BYTES[type_name])


def int4_groups(type_name: str, data: np.ndarray) -> Int4Groups:
    """A Q4_0/Q4_1 tensor's raw rows as int4 groups, exactly (see the module docstring)."""
    blocks = _blocks(type_name, data)
    rows, num_blocks, _ = blocks.shape
    d = _fp16(blocks, 0)
    zero = _fp16(blocks, 2) + 8 * d if type_name == "Q4_1" else np.zeros_like(d)
    packed = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
    # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, num_blocks * BLOCK)
    return Int4Groups(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def dequantize_q8_0(data: np.ndarray) -> torch.Tensor:
    """A Q8_0 tensor's raw rows as float32 values ``d * q``."""
    blocks = _blocks("Q8_0", data)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32)
    return torch.from_numpy((codes * _fp16(blocks, 0)[..., None]).reshape(blocks.shape[0], -1))


def _part_names(module_name: str, tensors: dict) -> list[str]:
    """The checkpoint tensors a linear layer of the loaded model is made of."""
    if module_name == "lm_head":
        return ["lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"]
    prefix, _, last = module_name.rpartition(".")
    return [f"model.{prefix}.{part}.weight" for part in FUSED_PARTS.get(last, (last,))]


def gguf_linear_methods(model: nn.Module, gguf_file: str | Path) -> dict[str, LinearMethod]:
    """Module name -> the quantized method holding that layer's blocks; layers with float weights
    in the file are left out (they keep the float weights already loaded)."""
    tensors = read_raw_tensors(gguf_file)
    methods: dict[str, LinearMethod] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        parts = _part_names(name, tensors)
        missing = [p for p in parts if p not in tensors]
        if missing:
            raise ValueError(f"quantization: gguf: {Path(gguf_file).name} has no tensor {missing[0]!r} for the "
                             f"model's layer {name!r}")
        types = sorted({tensors[p][0] for p in parts})
        if set(types) <= set(INT4_TYPES) and int4_shape_problem(layer.out_features, layer.in_features) is None:
            groups = Int4Groups.cat([int4_groups(tensors[p][0], tensors[p][1]) for p in parts])
            methods[name] = Int4LinearMethod(groups, note=f"GGUF {'/'.join(types)} blocks")
        elif set(types) <= set(INT4_TYPES + INT8_TYPES):
            values = torch.cat([dequantize_q8_0(tensors[p][1]) if tensors[p][0] == "Q8_0"
                                else int4_groups(tensors[p][0], tensors[p][1]).dequantize() for p in parts])
            methods[name] = Int8LinearMethod(values, note=f"GGUF {'/'.join(types)} requantized per row")
    return methods
