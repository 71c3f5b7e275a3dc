"""A PEFT adapter read from disk and checked against the base model before anything uses it.

PEFT saves an adapter as ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``target_modules``,
...) and ``adapter_model.safetensors`` with two matrices per adapted projection, named after the
module they adapt: ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``A``,
``[r, in]``) and ``...lora_B.weight`` (``B``, ``[out, r]``). The projection then computes
``x @ W.T + (x @ A.T) @ B.T * scaling`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` under
rsLoRA).

``load_adapter`` reads and checks everything (the rank against ``max_lora_rank``, every target
module against the model's projections, every shape against the model's sizes, every tensor a
floating-point one whose values are all finite) and returns a ``LoRAModel`` only if all of it holds:
a failed load raises ``LoRALoadError`` naming what is wrong and leaves nothing behind. The server
checks an adapter this way before it lists it; the workers load it the same way.

A ``LoRAModel`` carries ``digest``, a SHA-256 over its rank, scaling and every tensor's bytes: what
the prefix cache keys an adapter's blocks by (``LoRARequest.weights_digest``), so an adapter loaded
again with other weights under the same name and path never meets the K/V its old weights computed.
vLLM keys those blocks by the adapter's name alone (``_gen_lora_extra_hash_keys`` in
``vllm/v1/core/kv_cache_utils.py``), and loads integer or non-finite weights without a word.

vLLM: ``LoRAModel.from_local_checkpoint`` in ``vllm/lora/lora_model.py`` and ``PEFTHelper`` in
``vllm/lora/peft_helper.py``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.config import ModelConfig

# The projections of a decoder layer an adapter may target, and where each sits.
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_WEIGHT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRALoadError(ValueError):
    """An adapter that cannot be served on this model (the server answers 400)."""


@dataclass
class LoRAModel:
    """One adapter's weights: ``weights[(layer index, projection)] = (A [r, in], B [out, r])``."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the rank, the scaling and every tensor (in layer order): equal only for equal weights."""
        sha = hashlib.sha256(f"{self.rank}:{self.scaling!r}".encode())
        for (layer, projection), (a, b) in sorted(self.weights.items()):
            sha.update(f"{layer}.{projection}".encode())
            for tensor in (a, b):
                sha.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        return sha.hexdigest()


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's ``(in_features, out_features)`` in the base model."""
    hidden, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_adapter_config(path: str | Path) -> dict:
    try:
        file = Path(path) / "adapter_config.json"
        found = file.is_file()
    except (OSError, ValueError):  # a path no file system takes (a NUL byte, too long)
        found = False
    if not found:
        raise LoRALoadError(f"lora_path: {str(path)!r} holds no adapter_config.json (a PEFT adapter directory)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRALoadError(f"lora_path: adapter_config.json cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise LoRALoadError("lora_path: adapter_config.json must hold an object")
    return config


def check_adapter_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """The rank and scaling of a PEFT LoRA config this engine can serve; LoRALoadError otherwise."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"lora_path: a {config.get('peft_type')} adapter; only LoRA adapters are served")
    rank = config.get("r")
    if type(rank) is not int or rank < 1:
        raise LoRALoadError(f"lora_path: adapter_config.json's r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRALoadError(f"lora_path: the adapter's rank {rank} is above max_lora_rank={max_lora_rank}; "
                            f"restart with --max-lora-rank {rank} or more")
    for field, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("rank_pattern", {}),
                       ("alpha_pattern", {})):
        if config.get(field, off) not in (off, None, {}, []):
            raise LoRALoadError(f"lora_path: adapter_config.json's {field}={config[field]!r} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(PROJECTIONS))
        if lacking:
            raise LoRALoadError(f"lora_path: target_modules {lacking} are not projections of this model; an "
                                f"adapter may target {sorted(PROJECTIONS)}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRALoadError(f"lora_path: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def checked_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32, if it is a floating-point tensor whose values are all finite; LoRALoadError naming
    it otherwise (an integer adapter would be served as garbage, a NaN or an infinity fails every request)."""
    if not tensor.dtype.is_floating_point:
        raise LoRALoadError(f"lora_path: weight {name!r} holds {str(tensor.dtype).removeprefix('torch.')} values; "
                            "adapter weights must be floating point")
    tensor = tensor.float()
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = tensor[~finite][0].item()
        raise LoRALoadError(f"lora_path: weight {name!r} holds {int((~finite).sum())} value(s) that are not finite "
                            f"({'NaN' if bad != bad else bad}); adapter weights must be finite numbers")
    return tensor


def load_adapter(path: str | Path, model_config: ModelConfig, max_lora_rank: int) -> LoRAModel:
    """Read and check a PEFT adapter directory (module docstring); float32 tensors on the CPU."""
    from safetensors import safe_open

    rank, scaling = check_adapter_config(read_adapter_config(path), max_lora_rank)
    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():  # the directory exists: read_adapter_config found it
        raise LoRALoadError(f"lora_path: {str(path)!r} holds no adapter_model.safetensors")
    shapes = projection_shapes(model_config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():
                match = _WEIGHT_NAME.match(name)
                if match is None or match[3] not in PROJECTIONS or PROJECTIONS[match[3]] != match[2]:
                    raise LoRALoadError(f"lora_path: weight {name!r} adapts no projection of this model")
                layer = int(match[1])
                if layer >= model_config.num_hidden_layers:
                    raise LoRALoadError(f"lora_path: weight {name!r} is past the model's "
                                        f"{model_config.num_hidden_layers} layers")
                halves.setdefault((layer, match[3]), {})[match[4]] = checked_tensor(name, tensors.get_tensor(name))
    except LoRALoadError:
        raise
    except Exception as exc:  # a damaged file: safetensors' own error, as text
        raise LoRALoadError(f"lora_path: adapter_model.safetensors cannot be read: {exc}") from None
    weights = {}
    for (layer, projection), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRALoadError(f"lora_path: layer {layer}'s {projection} has lora_A or lora_B but not both")
        in_features, out_features = shapes[projection]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRALoadError(f"lora_path: layer {layer}'s {projection} has A {tuple(a.shape)} and B "
                                f"{tuple(b.shape)}; this model with r={rank} needs ({rank}, {in_features}) "
                                f"and ({out_features}, {rank})")
        weights[(layer, projection)] = (a.contiguous(), b.contiguous())
    if not weights:
        raise LoRALoadError(f"lora_path: {str(path)!r} adapts no projection")
    return LoRAModel(rank, scaling, weights)
