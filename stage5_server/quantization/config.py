"""Which method each linear layer gets: the ``quantization`` and ``prepack_linear`` engine
arguments, checked once (``EngineConfig``), and installed on the loaded model (``Worker``).

``quantization``: ``gguf`` (a GGUF file's Q4_0/Q4_1 blocks as int4 linears, ``gguf.py``), ``int8``
or ``int4`` (weight-only, quantized from the loaded float weights, ``weight_only.py``), ``none``
(the float weights), or None (as measured).
``prepack_linear``: the layers left in floating point run a weight packed once for oneDNN
(``packed.py``); a quantized layer keeps a packed copy beside its quantized one and runs it for
products of more than a few rows (``dispatch.py``). Left unset, each is chosen as measured on a
CPU (``docs/performance.md``): see ``AUTO_QUANTIZE_GGUF`` and ``AUTO_PREPACK``. Neither applies by
default in float32, the correctness reference.

vLLM: ``QuantizationConfig`` and ``get_quantization_config`` in
``vllm/model_executor/layers/quantization/__init__.py`` (``--quantization``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shared.config import ModelConfig
from shared.gguf import is_gguf
from stage5_server.model.linear import Linear
from stage5_server.quantization.dispatch import RowDispatchLinearMethod
from stage5_server.quantization.gguf import gguf_linear_methods
from stage5_server.quantization.packed import PackedLinearMethod, packing_available
from stage5_server.quantization.weight_only import (
    Int4LinearMethod,
    Int8LinearMethod,
    int4_shape_problem,
    kernel_available,
)

QUANTIZATION_METHODS = ("gguf", "int8", "int4")
NO_QUANTIZATION = "none"  # the float weights, whatever the measured default
# Defaults on a CPU in bfloat16, set from benchmarks/linear_methods.py on the default model: packed
# weights were faster than F.linear at every batch size, and the GGUF file's 4-bit blocks faster
# still for decode rows (with the packed copy for prefill and large batches).
AUTO_QUANTIZE_GGUF = True  # a quantized GGUF file runs its own blocks (quantization="gguf")
AUTO_PREPACK = True  # float products run oneDNN-packed weights


@dataclass(frozen=True)
class LinearConfig:
    quantization: str | None  # one of QUANTIZATION_METHODS; None: the float weights
    prepack: bool  # the layers left in floating point run packed weights
    gguf_file: str | None  # the GGUF file the checkpoint was converted from, if it was


def source_gguf_file(model: str | None, default_file) -> str | None:
    """The ``.gguf`` file a ``model`` argument names (``default_file()`` for the default model)."""
    if model is None or (model == "default" and not Path(model).exists()):
        return str(default_file())
    return str(model) if is_gguf(model) and Path(model).is_file() else None


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear layer of the fused model (``model/fused.py``)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter), "lm_head": (config.vocab_size, hidden)}


def resolve_linear_config(quantization: str | None, prepack: bool | None, gguf_file: str | None,
                          device: torch.device, dtype: torch.dtype, model_config: ModelConfig,
                          num_ranks: int) -> LinearConfig:
    """Check the two arguments against the model and the machine (``num_ranks``: TP x PP); fill in the
    measured defaults."""
    if quantization is not None and quantization not in (*QUANTIZATION_METHODS, NO_QUANTIZATION):
        raise ValueError(f"quantization: unknown method {quantization!r}; choose one of "
                         f"{[*QUANTIZATION_METHODS, NO_QUANTIZATION]}")
    if prepack not in (None, True, False):
        raise ValueError(f"prepack_linear: must be a bool, got {prepack!r}")
    fast_path = device.type == "cpu" and dtype == torch.bfloat16 and num_ranks == 1
    if quantization is None:
        if AUTO_QUANTIZE_GGUF and fast_path and gguf_file is not None and kernel_available("int4") \
                and kernel_available("int8"):
            quantization = "gguf"
    elif quantization == NO_QUANTIZATION:
        quantization = None
    else:
        _check_quantization(quantization, gguf_file, device, model_config, num_ranks)
    if prepack is None:
        prepack = AUTO_PREPACK and fast_path and packing_available()
    elif prepack and (device.type != "cpu" or num_ranks > 1):
        raise ValueError(f"prepack_linear: packs weights for a CPU's oneDNN on one rank; this engine runs on "
                         f"{device} with {num_ranks} rank(s)")
    return LinearConfig(quantization, prepack, gguf_file if quantization == "gguf" else None)


def _check_quantization(method: str, gguf_file: str | None, device: torch.device, model_config: ModelConfig,
                        num_ranks: int) -> None:
    if device.type != "cpu":
        raise ValueError(f"quantization: {method!r} runs torch's CPU kernels; this engine runs on {device}")
    if num_ranks > 1:
        raise ValueError(f"quantization: {method!r} runs on one rank; this engine has {num_ranks} "
                         "(tensor_parallel_size x pipeline_parallel_size)")
    kernels = ("int4", "int8") if method == "gguf" else (method,)
    for kernel in kernels:
        if not kernel_available(kernel):
            raise ValueError(f"quantization: {method!r} needs torch's {kernel} weight-only CPU kernels, which "
                             f"this torch ({torch.__version__}) lacks")
    if method == "gguf" and gguf_file is None:
        raise ValueError("quantization: 'gguf' keeps a GGUF file's blocks; the model is not a .gguf file")
    if method == "int4":
        for name, (out, inp) in linear_shapes(model_config).items():
            problem = int4_shape_problem(out, inp)
            if problem:
                raise ValueError(f"quantization: 'int4' cannot hold this model's {name} ({out}x{inp}): {problem}")


def install_linear_methods(model: nn.Module, linear: LinearConfig) -> str:
    """Give every linear layer of the (fused) model its method and process its weights; returns
    the start-up log line: which path each layer runs and what its weights take."""
    layers = {name: layer for name, layer in model.named_modules() if isinstance(layer, Linear)}
    float_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers.values())
    if linear.quantization == "gguf":
        methods = gguf_linear_methods(model, linear.gguf_file)
    elif linear.quantization in ("int8", "int4"):
        cls = Int8LinearMethod if linear.quantization == "int8" else Int4LinearMethod
        methods = {name: cls() for name in layers}  # one each: a method may hold its layer's source
    else:
        methods = {}
    packed = PackedLinearMethod() if linear.prepack else None  # holds nothing itself: one serves all
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, layer in layers.items():
        method = methods.get(name)
        if method is not None and packed is not None:
            method = RowDispatchLinearMethod(method, packed)
        method = method or packed
        if method is not None:
            layer.method = method
            method.process_weights_after_loading(layer)
        count = counts[layer.method.describe(layer)]
        count[0] += 1
        count[1] += layer.method.weight_bytes(layer)
    total = sum(b for _, b in counts.values())
    parts = ", ".join(f"{n} {kind}: {b / 2**20:.1f} MiB" for kind, (n, b) in counts.items())
    return f"linear layers: {parts}; {total / 2**20:.1f} MiB of weights (as loaded: {float_bytes / 2**20:.1f} MiB)"
