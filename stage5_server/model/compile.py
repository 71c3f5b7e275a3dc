"""torch.compile of the model forward on a CPU (inductor): the CPU counterpart of CUDA graphs.

Inductor turns each stretch of the forward between two attention calls (norms, the fused
projections, RoPE, SiLU-and-multiply, residual adds) into generated C++ with the elementwise
work fused into loops around the GEMMs. The attention backend itself stays eager: it reads
the step's metadata as Python lists and writes the KV cache in place, so it is a graph break
on purpose. Shapes are dynamic (the number of tokens changes every step), so one graph serves
every step after the first compile; the compile time is logged.

Opt-in (``enforce_eager=False``): on the CPUs measured so far it has not been faster than the
eager fused model (see the performance page). ``enforce_eager=True``, vLLM's flag, keeps eager.

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
    model.forward = torch.compile(model.forward, dynamic=True)
    logger.info("torch.compile: the model forward compiles on its first steps (inductor, dynamic shapes)")
