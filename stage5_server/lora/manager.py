"""The workers' adapters: ``max_loras`` slots in every adapted layer, and each step's token-to-slot map.

``LoRAModelManager(model, config)`` puts a ``LoRALinearMethod`` on every adaptable projection of the
fused model (over whatever method the layer had). Before each forward the model runner calls
``set_active_loras(states, num_scheduled)`` with the step's requests in packing order:

1. every adapter the step uses gets a slot: the one it already holds, else an empty slot, else the
   slot of the adapter used longest ago that this step does not use (the scheduler never puts more
   distinct adapters in a step than there are slots, so one is always free). Its weights come from
   a CPU copy: the one handed over when the adapter was checked (``add_lora``: by the server when it
   lists an adapter, by the offline ``LLM`` when it first meets one; the files are never read
   again, so deleting them changes nothing), else, for an engine driven directly, one loaded from
   ``lora_path`` once per ``(lora_int_id, lora_path)`` (``adapter.py``), kept for the
   ``max_cpu_loras`` adapters used last;
2. the step's ``LoRAMapping`` is rebuilt: per slot, the token rows of the requests that use it.

Under tensor parallelism each rank holds its part of every adapter, cut as the layer's weight is
(``rank_shards``): B by rows in a layer whose outputs are split, A by columns in one whose inputs are.

vLLM: ``LRUCacheWorkerLoRAManager`` in ``vllm/lora/worker_manager.py`` (``set_active_adapters``,
``add_adapter``, ``remove_adapter``),
``LoRAModelManager`` in ``vllm/lora/model_manager.py``, the mapping in ``vllm/lora/layers/utils.py``
and ``PunicaWrapperBase.update_metadata``; the cuts are ``slice_lora_a`` / ``slice_lora_b`` of
``vllm/lora/layers/column_parallel_linear.py`` and ``row_parallel_linear.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from shared.config import ModelConfig
from stage5_server.config.lora import LoRAConfig
from stage5_server.lora.adapter import LoRAModel, load_adapter
from stage5_server.lora.layers import LoRALinearMethod, LoRAMapping, SlotWeights, block_diagonal_b
from stage5_server.lora.request import LoRARequest
from stage5_server.model.linear import Linear
from stage5_server.parallel.parallel_state import RankPlace, tensor_parallel_shape

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig

# The fused model's adapted layers: attribute path under a decoder layer -> the projections it holds.
ADAPTED_LAYERS = {("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"), ("self_attn", "o_proj"): ("o_proj",),
                  ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"), ("mlp", "down_proj"): ("down_proj",)}


# Under tensor parallelism, the layers whose *input* features are split (RowParallelLinear): their A is
# cut by columns and their partial deltas are summed by the layer's own all-reduce. The others split
# their output features: their B is cut by rows, each rank adding its own slice of the delta.
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


class LoRAModelManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: LoRAConfig, max_cpu_loras: int = 8,
                 tp_rank: int = 0, tp_size: int = 1):
        self.config, self.model_config = config, model_config
        self.mapping = LoRAMapping(scalings=[0.0] * config.max_loras)
        self.layers: dict[tuple[int, tuple[str, ...]], LoRALinearMethod] = {}
        self.shards = rank_shards(model_config, tp_rank, tp_size)  # projection -> (start, size); {} on one rank
        for index, decoder_layer in enumerate(model.layers):
            for (parent, name), projections in ADAPTED_LAYERS.items():
                layer: Linear = getattr(getattr(decoder_layer, parent), name)
                sizes = _slice_sizes(layer, projections, model_config)
                if self.shards and projections[0] not in ROW_PARALLEL:
                    sizes = [self.shards[p][1] for p in projections]
                method = LoRALinearMethod(layer.method, sizes, self.mapping, config.max_loras, config.max_lora_rank)
                layer.method = method
                self.layers[(index, projections)] = method
        self.device, self.dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.slots: list[LoRARequest | None] = [None] * config.max_loras
        self.last_used = [0] * config.max_loras
        self.steps = 0
        self.max_cpu_loras = max(max_cpu_loras, config.max_loras)
        self.cpu_cache: OrderedDict[tuple[int, str], LoRAModel] = OrderedDict()
        self.held: dict[tuple[int, str], LoRAModel] = {}  # handed over by add_lora, kept until remove_lora

    @classmethod
    def for_rank(cls, model: nn.Module, config: EngineConfig, place: RankPlace) -> LoRAModelManager | None:
        """The manager of a rank's model (its part of each adapter, when the model is split); None without
        ``enable_lora``."""
        if config.lora is None:
            return None
        return cls(model, config.model_config, config.lora, tp_rank=place.tp_rank,
                   tp_size=config.parallel.tensor_parallel_size)

    # ---- one step --------------------------------------------------------------------------
    def set_active_loras(self, requests: Sequence[LoRARequest | None], num_scheduled: Sequence[int]) -> None:
        """Slots for the step's adapters, and the rows each slot covers (module docstring)."""
        self.steps += 1
        wanted = list(dict.fromkeys(r for r in requests if r is not None))
        if len(wanted) > len(self.slots):  # the scheduler's promise (core/scheduler.py)
            raise RuntimeError(f"a step with {len(wanted)} adapters; there are {len(self.slots)} slots (max_loras)")
        slot_of = {lora: self._slot_for(lora, wanted) for lora in wanted}
        rows: dict[int, list[torch.Tensor]] = {}
        start, total = 0, sum(num_scheduled)
        for lora, count in zip(requests, num_scheduled):
            if lora is not None:
                rows.setdefault(slot_of[lora], []).append(torch.arange(start, start + count))  # on the CPU
            start += count
        segments = []
        for slot, parts in sorted(rows.items()):
            index = torch.cat(parts) if len(parts) > 1 else parts[0]
            segments.append((slot, None if len(index) == total else index.to(self.device)))
        self.mapping.segments = segments
        self._pad(segments)

    def step_has_adapters(self) -> bool:
        """Whether the step ``set_active_loras`` set up adapts any row. A compiled step (``model/compile.py``)
        was traced without adapters and runs only the steps that have none; the others run eagerly."""
        return bool(self.mapping.segments)

    def _pad(self, segments: list[tuple[int, torch.Tensor | None]]) -> None:
        """With several segments, their rows as one ``[adapters, longest]`` batch (``layers.py``)."""
        mapping = self.mapping
        if len(segments) < 2:
            mapping.slots = mapping.padded_rows = mapping.padded_scaling = None
            return
        longest = max(len(rows) for _, rows in segments)
        padded = torch.stack([torch.cat([rows, rows[:1].expand(longest - len(rows))]) for _, rows in segments])
        scaling = torch.zeros(len(segments), longest, 1)
        for i, (slot, rows) in enumerate(segments):
            scaling[i, :len(rows)] = mapping.scalings[slot]
        mapping.slots = torch.tensor([slot for slot, _ in segments], device=self.device)
        mapping.padded_rows = padded.reshape(-1).to(self.device)
        mapping.padded_scaling = scaling.to(self.device, self.dtype)

    def _slot_for(self, lora: LoRARequest, wanted: list[LoRARequest]) -> int:
        if lora in self.slots:
            slot = self.slots.index(lora)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None or held not in wanted]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.last_used[s]))
            self._activate(slot, lora)
        self.last_used[slot] = self.steps
        return slot

    def _activate(self, slot: int, lora: LoRARequest) -> None:
        """Copy ``lora``'s weights into ``slot`` of every layer (loading them first if need be)."""
        adapter = self.load(lora)
        device, dtype = self.device, self.dtype
        for (index, projections), method in self.layers.items():
            pairs = [self._rank_part(p, adapter.weights.get((index, p))) for p in projections]
            if all(pair is None for pair in pairs):
                method.set_slot(slot, None)
                continue
            in_features = next(pair[0].shape[1] for pair in pairs if pair is not None)
            a = torch.cat([torch.zeros(adapter.rank, in_features) if pair is None else pair[0] for pair in pairs])
            b = block_diagonal_b([None if pair is None else pair[1] for pair in pairs], method.slice_sizes,
                                 adapter.rank)
            method.set_slot(slot, SlotWeights(a.to(device, dtype), b.to(device, dtype), adapter.rank))
        self.mapping.scalings[slot] = adapter.scaling
        self.slots[slot] = lora

    def _rank_part(self, projection: str, pair: tuple[torch.Tensor, torch.Tensor] | None):
        """This rank's part of one projection's ``(A, B)``: A's columns of its input slice for a
        row-parallel layer, B's rows of its output slice for the others; all of it on one rank."""
        if pair is None or not self.shards:
            return pair
        a, b = pair
        start, size = self.shards[projection]
        if projection in ROW_PARALLEL:
            return a[:, start:start + size], b
        return a, b[start:start + size]

    # ---- the CPU copies ----------------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest, adapter: LoRAModel) -> None:
        """Keep ``adapter`` (already checked, ``adapter.py``) as ``lora``'s weights until ``remove_lora``."""
        self.held[lora.key] = adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop the CPU copies of adapter ``lora_int_id`` (a slot holding it is reused once another needs
        it); whether there were any."""
        keys = [key for key in (*self.held, *self.cpu_cache) if key[0] == lora_int_id]
        for key in keys:
            self.held.pop(key, None)
            self.cpu_cache.pop(key, None)
        return bool(keys)

    def load(self, lora: LoRARequest) -> LoRAModel:
        """The CPU copy of ``lora``'s weights: the one handed over, else read from its path once (LRU over
        ``max_cpu_loras``)."""
        held = self.held.get(lora.key)
        if held is not None:
            return held
        adapter = self.cpu_cache.get(lora.key)
        if adapter is None:
            adapter = load_adapter(lora.lora_path, self.model_config, self.config.max_lora_rank)
            self.cpu_cache[lora.key] = adapter
            while len(self.cpu_cache) > self.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        self.cpu_cache.move_to_end(lora.key)
        return adapter


def _slice_sizes(layer: Linear, projections: tuple[str, ...], config: ModelConfig) -> list[int]:
    if len(projections) == 1:
        return [layer.out_features]
    if projections[0] == "q_proj":
        kv = config.num_key_value_heads * config.head_dim
        return [config.num_attention_heads * config.head_dim, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def rank_shards(config: ModelConfig, rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """Where rank ``rank``'s slice of each projection starts and how wide it is (output features, or input
    features for ``ROW_PARALLEL`` layers), as ``parallel/sharded_model.py`` splits the weights."""
    if world_size == 1:
        return {}
    shape = tensor_parallel_shape(config, world_size)
    head_dim, columns = config.head_dim, shape.intermediate_size
    q = (rank * shape.num_heads * head_dim, shape.num_heads * head_dim)
    kv = (shape.kv_head_start(rank) * head_dim, shape.num_kv_heads * head_dim)
    mlp = (rank * columns, columns)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q, "gate_proj": mlp, "up_proj": mlp,
            "down_proj": mlp}
