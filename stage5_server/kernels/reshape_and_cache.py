"""Write this step's new keys and values into the paged KV cache.

Before attention runs, every new token's K/V row must land in its cache slot. The scheduler
already chose the slots: ``slot_mapping[t]`` is the flat slot of token ``t``, i.e.
``block_id * block_size + offset``. One Triton program copies one token: it splits the slot
back into (block, offset) and stores ``key[t]`` (all KV heads) at
``key_cache[block, offset]``, and the same for values. A negative slot means "do not
write" (padding tokens).

vLLM: ``reshape_and_cache_flash`` in ``csrc/cache_kernels.cu`` and its Triton port
``vllm/attention/ops/triton_reshape_and_cache_flash.py``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# @triton.jit decides at decoration time whether to compile or to interpret, so this is read
# when the kernel modules are imported, not when a kernel is launched.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Raise a clear error, instead of Triton's, when the kernels cannot run on these tensors."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    device = devices.pop()
    if device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "Triton kernels need a GPU; to run them on CPU tensors set TRITON_INTERPRET=1 "
            "in the environment before importing stage5_server.kernels"
        )
    if device.type != "cpu" and INTERPRET:
        raise RuntimeError("TRITON_INTERPRET=1 runs kernels on CPU tensors only; unset it to use the GPU")


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to cache
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
                  mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
                    mask=mask)
    key_dst = (key_cache_ptr + block_id * stride_kcb + offset * stride_kcs
               + heads[:, None] * stride_kch + dims[None, :] * stride_kcd)
    value_dst = (value_cache_ptr + block_id * stride_vcb + offset * stride_vcs
                 + heads[:, None] * stride_vch + dims[None, :] * stride_vcd)
    tl.store(key_dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key/value [T, Hkv, D]`` into ``key_cache/value_cache [num_blocks, B, Hkv, D]``.

    Token ``t`` goes to flat slot ``slot_mapping[t]`` (``block * B + offset``); slots ``< 0``
    are skipped. Writes the caches in place; inputs may be non-contiguous views.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, Hkv, D]")
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"key is [T, {num_kv_heads}, {head_dim}] but the cache holds "
                         f"[..., {key_cache.shape[2]}, {key_cache.shape[3]}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    check_device(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(),
        num_kv_heads,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
