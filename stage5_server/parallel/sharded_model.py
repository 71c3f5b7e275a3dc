"""One rank's shard of ``shared``'s ``DecoderModel``, read straight from the Hugging Face checkpoint.

A rank builds the ordinary ``DecoderModel`` with its own head counts and MLP width, then swaps
in the parallel layers of ``layers.py`` where the weights are split; its query heads attend to
its own KV heads. Each tensor is read with ``safe_open(...).get_slice``: only the rank's part.

vLLM: each model's ``load_weights`` with the layers' ``weight_loader``
(``vllm/model_executor/models/llama.py``, ``vllm/model_executor/layers/linear.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shared.config import ModelConfig
from shared.model import DecoderModel
from shared.weights import load_weights
from stage5_server.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from stage5_server.parallel.parallel_state import TensorParallelShape, tensor_parallel_shape


def rank_config(config: ModelConfig, shape: TensorParallelShape) -> ModelConfig:
    """The config one rank's ``DecoderModel`` is built from (and its KV cache is sized by)."""
    return dataclasses.replace(config, num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                               intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_per_rank)


def build_sharded_model(config: ModelConfig, rank: int, world_size: int) -> DecoderModel:
    """The rank's model with parallel layers in place, on the ``meta`` device (no memory yet)."""
    shape = tensor_parallel_shape(config, world_size)
    hidden, head_dim, bias = config.hidden_size, config.head_dim, config.attention_bias
    q_width, kv_width = shape.num_heads * head_dim, shape.num_kv_heads * head_dim
    kv_start = shape.kv_head_start(rank) * head_dim
    with torch.device("meta"):
        model = DecoderModel(rank_config(config, shape))
        vocab_start = rank * shape.vocab_per_rank
        model.embed_tokens = VocabParallelEmbedding(shape.vocab_per_rank, hidden, vocab_start, config.vocab_size)
        model.lm_head = ParallelLMHead(shape.vocab_per_rank, hidden, vocab_start, config.vocab_size)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj = ColumnParallelLinear(hidden, q_width, bias, start=rank * q_width)
            attn.k_proj = ColumnParallelLinear(hidden, kv_width, bias, start=kv_start)
            attn.v_proj = ColumnParallelLinear(hidden, kv_width, bias, start=kv_start)
            attn.o_proj = RowParallelLinear(q_width, hidden, False, start=rank * q_width)
            columns = shape.intermediate_size
            mlp.gate_proj = ColumnParallelLinear(hidden, columns, False, start=rank * columns)
            mlp.up_proj = ColumnParallelLinear(hidden, columns, False, start=rank * columns)
            mlp.down_proj = RowParallelLinear(columns, hidden, False, start=rank * columns)
    return model


def load_sharded_model(path: str | Path, rank: int, world_size: int, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> tuple[DecoderModel, ModelConfig]:
    """Build rank ``rank``'s shard and fill it from the checkpoint; returns it and the *full* config."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    model = build_sharded_model(config, rank, world_size)
    load_weights(model, config, path, dtype, device, shard_reader(model))  # ties lm_head to the same slice
    return model.eval(), config


def shard_reader(model: DecoderModel):
    """``load_weights``' ``take``: each tensor's part that ``model``'s layer holds (``load_shard``), else all."""

    def take(name: str, full) -> torch.Tensor:
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        return module.load_shard(param_name, full) if hasattr(module, "load_shard") else full[:]

    return take
