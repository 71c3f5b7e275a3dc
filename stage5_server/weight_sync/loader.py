"""New weights into a running rank's model, in place, by the checkpoint's names.

A rank's live model is not the checkpoint's layout: its q/k/v and gate/up projections are fused
(``model/fused.py``), a tensor-parallel rank holds a slice of each tensor (``parallel/sharded_model.py``),
a pipeline stage holds some layers, renumbered (``parallel/pipeline.py``), and a packed or quantized
layer keeps its weight in its method's own form (``quantization/``). ``RankWeightLoader`` builds the
same skeleton the rank was loaded from, on the ``meta`` device (no memory), and for each incoming
``(name, tensor)`` reuses the load path's own pieces: the stage's ``rename``, the layer's ``load_shard``.
It then writes the shard into the fused weight at its rows. A plain layer's weight is written in
place; a layer whose method processed its weight after loading (packed, int8, int4) gets its whole
weight back and runs ``process_weights_after_loading`` again, so it needs every part (q, k and v) in
one update. LoRA methods wrap a layer's own method and keep their adapter slots.

vLLM: each model's ``load_weights`` and ``stacked_params_mapping`` (``vllm/model_executor/models/llama.py``),
the ``weight_loader`` of ``QKVParallelLinear`` (``vllm/model_executor/layers/linear.py``), and
``process_weights_after_loading`` in ``vllm/model_executor/model_loader/utils.py``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shared.model import DecoderModel
from stage5_server.model.linear import Linear, LinearMethod
from stage5_server.multimodal.vision import decoder_tensor_name
from stage5_server.parallel.parallel_state import RankPlace
from stage5_server.parallel.pipeline import build_stage_model
from stage5_server.parallel.sharded_model import build_sharded_model, shard_reader

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig

# A checkpoint projection -> (the fused projection that holds it, its place among the fused parts).
FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
PARTS_OF = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _base_method(method: LinearMethod) -> LinearMethod:
    """The method that processed the layer's weight (a LoRA method wraps it as ``base``)."""
    return getattr(method, "base", method)


def processes_weights(layer: Linear) -> bool:
    """The layer's method rewrote its weight after loading (packed, quantized): it keeps no plain copy."""
    return type(_base_method(layer.method)) is not LinearMethod


class RankWeightLoader:
    """Loads checkpoint-named tensors into one rank's live decoder (module docstring)."""

    def __init__(self, config: EngineConfig, place: RankPlace, live: DecoderModel):
        if config.linear.quantization == "gguf":
            raise ValueError("update_weights: a GGUF model runs its file's own 4-bit blocks; weights cannot be "
                             "updated in place (serve the float checkpoint, or quantization='int8'/'int4')")
        self.live = live
        self.dtype = config.dtype
        self.model_config = config.model_config
        self.rename = decoder_tensor_name if config.multimodal is not None else None
        parallel = config.parallel
        if parallel.pipeline_parallel_size > 1:
            reference, self.model_config, self.rename = build_stage_model(config.model_config, place)
        elif parallel.world_size > 1:
            reference = build_sharded_model(config.model_config, place.rank, parallel.world_size)
        else:
            with torch.device("meta"):
                reference = DecoderModel(config.model_config)
        self.reference = reference  # the unfused skeleton: each tensor's shape on this rank
        self.shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
        self.take = shard_reader(reference) if parallel.tensor_parallel_size > 1 else None

    def checkpoint_name(self, name: str) -> str | None:
        """``name``'s parameter in the rank's unfused model; None for a tensor this rank does not hold."""
        short = name.removeprefix("model.")
        if self.rename is not None and (short := self.rename(short)) is None:
            return None
        tied_head = short == "lm_head.weight" and self.model_config.tie_word_embeddings
        if "rotary_emb" in short or short.endswith("position_ids") or tied_head:  # derived, not weights
            return None
        if short not in self.shapes:
            raise ValueError(f"update_weights: tensor {name!r} has no place in the {self.model_config.family} model")
        return short

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Load every tensor this rank holds; returns their names in the unfused model. Refuses (before
        writing anything) a tensor with no place or the wrong shape, and a processed layer missing parts."""
        writes: list[tuple[nn.Module, str, int, torch.Tensor]] = []  # (live module, param, row offset, shard)
        processed: dict[Linear, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
        loaded = []
        for name, tensor in named_tensors:
            short = self.checkpoint_name(name)
            if short is None:
                continue
            shard = self.take(short, tensor) if self.take is not None else tensor
            if tuple(shard.shape) != self.shapes[short]:
                raise ValueError(f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}; this model's "
                                 f"{short} takes {self.shapes[short]} (on this rank)")
            module, param, part, offset = self.target(short)
            shard = shard.detach().to(self.dtype)
            if isinstance(module, Linear) and param == "weight" and processes_weights(module):
                processed[module][param][part] = shard
            else:
                writes.append((module, param, offset, shard))
            loaded.append(short)
        for layer, params in processed.items():  # check before any write
            parts = params["weight"]
            if len(parts) != len(self.part_names(layer)):
                raise ValueError(f"update_weights: {layer.method.describe(layer)} layers keep no plain weight; "
                                 f"give all of {self.part_names(layer)} of a layer in one update")
        with torch.no_grad():
            for module, param, offset, shard in writes:
                self.write(module, param, offset, shard)
            for layer, params in processed.items():
                parts = params["weight"]
                weight = torch.cat([parts[i] for i in sorted(parts)]).to(self.device_of(layer))
                layer.weight = nn.Parameter(weight, requires_grad=False)
                _base_method(layer.method).process_weights_after_loading(layer)
                layer.dropped = False
            if self.model_config.tie_word_embeddings and "embed_tokens.weight" in loaded:
                self.retie_head()
        return loaded

    def target(self, short: str) -> tuple[nn.Module, str, int, int]:
        """(live module, its parameter, part index, row offset) where the unfused parameter ``short`` lives."""
        module_name, _, param = short.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in FUSED_PARTS:
            fused, part = FUSED_PARTS[leaf]
            offset = sum(self.reference.get_submodule(f"{parent}.{p}").out_features
                         for p in PARTS_OF[fused][:part])
            return self.live.get_submodule(f"{parent}.{fused}"), param, part, offset
        return self.live.get_submodule(module_name), param, 0, 0

    def part_names(self, layer: Linear) -> tuple[str, ...]:
        name = next(n for n, m in self.live.named_modules() if m is layer).rpartition(".")[2]
        return PARTS_OF.get(name, (name,))

    def device_of(self, module: nn.Module) -> torch.device:
        return next(t.device for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta")

    def write(self, module: nn.Module, param: str, offset: int, shard: torch.Tensor) -> None:
        """Rows ``[offset, offset + len(shard))`` of ``module.param``; a parameter dropped by ``sleep(level=2)``
        is given its full size first."""
        current = getattr(module, param)
        full_rows = self.full_rows(module, param)
        if current.numel() == 0:  # dropped: allocate it again (its other rows arrive in this update or later)
            shape = (full_rows, *shard.shape[1:])
            current = nn.Parameter(torch.empty(shape, dtype=self.dtype, device=current.device), requires_grad=False)
            setattr(module, param, current)
        current.data[offset:offset + shard.shape[0]].copy_(shard.to(current.device))

    def full_rows(self, module: nn.Module, param: str) -> int:
        name = next(n for n, m in self.live.named_modules() if m is module)
        parent, _, leaf = name.rpartition(".")
        if leaf in PARTS_OF:
            return sum(self.shapes[f"{parent}.{p}.{param}"][0] for p in PARTS_OF[leaf])
        return self.shapes[f"{name}.{param}"][0]

    def retie_head(self) -> None:
        """A tied LM head whose method packed its own copy of the embedding: packed again from the new one."""
        head = getattr(self.live, "lm_head", None)
        if isinstance(head, Linear) and processes_weights(head):
            head.weight = self.live.embed_tokens.weight
            _base_method(head.method).process_weights_after_loading(head)
        elif hasattr(head, "weight") and head.weight is not self.live.embed_tokens.weight:
            head.weight = self.live.embed_tokens.weight  # dropped by a level-2 sleep: shared again

    def missing(self) -> list[str]:
        """The live model's parameters that hold no weights (dropped by ``sleep(level=2)``, not loaded since)."""
        return [name for name, p in self.live.named_parameters() if p.numel() == 0
                and not self.holds_processed_copy(name)]

    def holds_processed_copy(self, name: str) -> bool:
        module = self.live.get_submodule(name.rpartition(".")[0])
        return isinstance(module, Linear) and processes_weights(module) and not getattr(module, "dropped", False)

    def drop(self) -> int:
        """Free every weight (``sleep(level=2)``); the bytes freed."""
        freed = 0
        for module in self.live.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                freed += param.numel() * param.element_size()
                setattr(module, name, nn.Parameter(param.new_empty(0), requires_grad=False))
            if isinstance(module, Linear) and processes_weights(module):
                for attr, value in list(vars(module).items()):  # the method's processed copies (packed, int8)
                    if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                        freed += value.numel() * value.element_size()
                        setattr(module, attr, None)
                module.dropped = True
        return freed


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take, a processed layer's own copies included."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Linear):
            total += sum(v.numel() * v.element_size() for k, v in vars(module).items()
                         if isinstance(v, torch.Tensor) and not k.startswith("_"))
    return total


def describe_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of each tensor: what a broadcast's receivers allocate."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named_tensors]


def tensor_dtype(name: str) -> Any:
    return getattr(torch, name)
