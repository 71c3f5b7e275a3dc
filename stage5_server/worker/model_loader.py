"""The weights one rank runs: which decoder it holds, loaded, rearranged and given its linear methods.

- a pipeline stage's layers (``parallel/pipeline.py``), or a tensor-parallel rank's shard of every
  layer (``parallel/sharded_model.py``), or, on one device, the whole decoder (a vision-language
  checkpoint's sits under ``language_model.``: ``multimodal/vision.py``);
- then rearranged for speed: q/k/v and gate/up fused into one GEMM each (``model/fused.py``), and
  in bfloat16 or float16 on a CPU the norms, SiLU and RoPE one C++ operator each (``cpu_kernels/``);
- then, on one device, each projection's product given to a packed or quantized method
  (``quantization/``; a split model keeps plain linears). The start-up log names each path.

vLLM: ``vllm/model_executor/model_loader/`` (``get_model``, ``DefaultModelLoader``, ``GGUFModelLoader``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from shared.model import DecoderModel
from shared.weights import load_model
from stage5_server.cpu_kernels import cpu_elementwise_kernels
from stage5_server.model import fuse_projections, use_elementwise_kernels
from stage5_server.multimodal.vision import decoder_tensor_name
from stage5_server.parallel.parallel_state import RankPlace
from stage5_server.parallel.pipeline import load_stage_model
from stage5_server.parallel.sharded_model import load_sharded_model
from stage5_server.quantization import install_linear_methods

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig

logger = logging.getLogger("stagedserve")


def load_rank_model(config: EngineConfig, place: RankPlace, device: torch.device) -> DecoderModel:
    parallel = config.parallel
    if parallel.pipeline_parallel_size > 1:
        model = load_stage_model(config.model_path, place, config.dtype, device)
    elif parallel.world_size > 1:
        model, _ = load_sharded_model(config.model_path, place.rank, parallel.world_size, config.dtype, device)
    elif config.multimodal is not None:  # a vision-language checkpoint: its decoder, under language_model.
        model, _ = load_model(config.model_path, config.dtype, device, config.model_config, decoder_tensor_name)
    else:
        model, _ = load_model(config.model_path, config.dtype, device)
    kernels = cpu_elementwise_kernels(device, config.dtype)
    model = use_elementwise_kernels(fuse_projections(model), kernels)
    if kernels is not None:
        logger.info("RMSNorm, SiLU(gate) * up and RoPE: one C++ operator each (cpu_kernels/elementwise.py)")
    if parallel.world_size == 1:
        logger.info(install_linear_methods(model, config.linear))
    return model
