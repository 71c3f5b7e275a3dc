"""Pipeline parallelism: the layers split into stages, hidden states handed from stage to stage.

With ``pipeline_parallel_size=P`` the decoder's layers are cut into P consecutive runs
(``stage_layers``); stage 0 also holds the token embedding, the last stage the final norm and the
LM head. Each rank builds only its stage (``load_stage_model``: its layers renumbered from 0, so its
KV cache has a slot for its own layers only) and reads only those tensors from the checkpoint.
A step runs stage by stage: every stage gets the same ``SchedulerOutput`` and prepares the same
positions, stage 0 embeds the tokens, each stage but the last sends its output to the next
(``PipelineStage.forward``), and the last stage computes logits and samples. Under tensor
parallelism too, each TP rank of a stage hands its (identical) hidden states to the same TP rank
of the next.

One batch keeps one stage busy at a time: the others wait, the *bubble*. The engine core keeps
up to P batches in flight (``core/engine_core.py``'s batch queue), so that under load each stage
works on a different batch.

vLLM: ``get_pp_indices`` in ``vllm/distributed/utils.py``, ``PPMissingLayer`` and
``make_layers`` in ``vllm/model_executor/models/utils.py``, ``IntermediateTensors`` in
``vllm/sequence.py``, the PP branch of ``GPUModelRunner.execute_model``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared.config import ModelConfig
from shared.model import DecoderModel
from shared.weights import load_weights
from stage5_server.parallel.parallel_state import RankPlace, recv_hidden, send_hidden
from stage5_server.parallel.sharded_model import build_sharded_model, shard_reader


def stage_layers(num_layers: int, pipeline_parallel_size: int, pp_rank: int) -> range:
    """The layers stage ``pp_rank`` runs: an even split, the first stages taking one more each when it
    does not divide (the last stage also runs the LM head). vLLM gives the extra layers to the
    later stages instead; either is a choice of where to put the imbalance."""
    base, extra = divmod(num_layers, pipeline_parallel_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def load_stage_model(path: str | Path, place: RankPlace, dtype: torch.dtype,
                     device: torch.device) -> DecoderModel:
    """Rank ``place``'s part of the model: its stage's layers (its TP shard of them), numbered from 0,
    plus the embedding on the first stage and the norm and LM head on the last."""
    path = Path(path)
    model, stage_config, rename = build_stage_model(ModelConfig.from_pretrained(path), place)
    take = shard_reader(model) if place.tensor_parallel_size > 1 else None
    load_weights(model, stage_config, path, dtype, device, take, rename)
    return model.eval()


def build_stage_model(config: ModelConfig, place: RankPlace) -> tuple[DecoderModel, ModelConfig, Any]:
    """Rank ``place``'s stage on the ``meta`` device (no memory yet), its config, and ``rename``: a checkpoint
    tensor's name in the stage (its layer renumbered), or None for a tensor another stage holds."""
    layers = stage_layers(config.num_hidden_layers, place.pipeline_parallel_size, place.pp_rank)
    last = place.is_last_stage
    keeps_embedding = place.is_first_stage or (last and config.tie_word_embeddings)  # a tied head is the embedding
    stage_config = dataclasses.replace(config, num_hidden_layers=len(layers),
                                       tie_word_embeddings=config.tie_word_embeddings and last)
    if place.tensor_parallel_size > 1:
        model = build_sharded_model(stage_config, place.tp_rank, place.tensor_parallel_size)
    else:
        with torch.device("meta"):
            model = DecoderModel(stage_config)
    if not keeps_embedding:
        model.embed_tokens = nn.Identity()
    if not last:
        model.norm, model.lm_head = nn.Identity(), nn.Identity()

    def rename(name: str) -> str | None:
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            return f"layers.{int(index) - layers.start}.{rest}" if int(index) in layers else None
        if name.startswith("embed_tokens."):
            return name if keeps_embedding else None
        if name.startswith(("norm.", "lm_head.")):
            return name if last else None
        return name

    return model, stage_config, rename


class PipelineStage(nn.Module):
    """One stage's model as the runner sees it: ``forward`` returns the final hidden states on the last
    stage and None on the others, which have sent theirs on."""

    def __init__(self, model: DecoderModel, place: RankPlace, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.model = model
        self.place = place
        self.config = model.config
        self.dtype, self.device = dtype, device  # of the hidden states a stage receives
        self.waits: list[tuple[float, float]] = []  # the last step's waits for its neighbours: (start, end)

    def set_attention_backend(self, backend) -> None:
        self.model.set_attention_backend(backend)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor | None:
        model, place = self.model, self.place
        self.waits = []
        if place.is_first_stage:
            hidden = model.embed_tokens(input_ids)
        else:
            start = time.monotonic()
            hidden = recv_hidden(input_ids.shape[0], self.config.hidden_size, self.dtype, self.device,
                                 place.prev_rank)
            self.waits.append((start, time.monotonic()))
        for layer in model.layers:
            hidden = layer(positions, hidden, attn_metadata, model.rotary_emb)
        if not place.is_last_stage:  # returns once the next stage has taken it (it may still be busy)
            start = time.monotonic()
            send_hidden(hidden, place.next_rank)
            self.waits.append((start, time.monotonic()))
            return None
        return model.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
