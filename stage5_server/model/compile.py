"""torch.compile of the model forward on a CPU (inductor): the CPU counterpart of CUDA graphs.

Inductor fuses each stretch between two attention calls into generated C++; attention stays
eager (a graph break on purpose: it reads Python metadata and writes the KV cache in place).
Shapes are dynamic, so one graph serves every step. Opt-in (``enforce_eager=False``): on the
CPUs measured it has not beaten the eager fused model.

vLLM: ``vllm/compilation/`` (its piecewise compile splits the graph at attention the same way).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("stagedserve")


class EagerAttention:
    """Runs a backend outside the compiled graph."""

    def __init__(self, backend):
        self.backend = backend

    @torch.compiler.disable
    def forward(self, layer_idx, query, key, value, attn_metadata, scale):
        return self.backend.forward(layer_idx, query, key, value, attn_metadata, scale)


def compile_model(model, backend) -> None:
    """Install ``backend`` behind a graph break and compile ``model.forward`` (on its first call)."""
    model.set_attention_backend(EagerAttention(backend))
    # The layers differ in their weights and their index: with the index a dynamic int, one graph
    # serves every layer (a static one recompiles per layer, and past dynamo's limit of eight
    # recompiles the rest run uncompiled).
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    model.forward = torch.compile(model.forward, dynamic=True)
    logger.info("torch.compile: the model forward compiles on its first steps (inductor, dynamic shapes)")
