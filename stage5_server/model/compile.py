"""A compiled step on a CPU: what CUDA graphs are to a GPU.

A step of a few tokens pushes a few rows through every layer. Each operator is tiny, so eager
PyTorch spends more time walking modules and dispatching about 140 operators a layer from Python
than computing them. ``CompiledDecodeForward`` compiles the whole forward once with inductor
(``fullgraph=True``: no graph break) for steps of up to ``max_tokens`` tokens. In that graph,
attention is one operator a layer (``cpu_kernels``' ``decode_step_attention``: it writes the step's
K/V, then attends each row in place); RMSNorm, RoPE, SiLU-and-multiply and the residual adds become
generated C++ loops; the linear layers' int4/packed kernels are called directly.

The graph sees only decodes: one query row per sequence. A step that is not (a speculative verify
step, 1 + k positions of one request; the last short chunk of a prompt) becomes one: the token at
position ``p`` is a decode row over its request's blocks that sees ``p + 1`` tokens. The operator
writes every row's K/V before any row attends, so each row sees the tokens before it in the same
step, which is the causal mask of the eager path.

Two graphs serve every such step: one row, and 2 to ``max_tokens`` rows (dynamic sizes, so no
padding). Both are compiled at start-up by ``capture`` on a dummy step that writes nothing, so no
request waits for a compiler; inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default
under the temp directory) makes the next start-up quicker. Per call, dynamo checks only its guards
on the step's inputs, which tell the two graphs apart, not the thousands on the model's modules
and weights (vLLM drops its guards too). Every other step (more tokens, an image's embeddings)
runs the eager forward.

vLLM: ``vllm/compilation/`` (``backends.py``'s ``VllmBackend``; ``cuda_graph.py``: graphs captured
per batch size at start-up, ``cudagraph_capture_sizes``; ``wrapper.py``'s
``TorchCompileGuardsStripWrapper``) and ``capture_model`` in ``vllm/v1/worker/gpu_model_runner.py``;
its CUDA graphs for uniform decode and verify batches: ``uniform_decode_query_len`` there.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import re
import time
import types

import torch

from stage2_paged.attention import PagedAttentionMetadata
from stage5_server.model.linear import Linear

logger = logging.getLogger("stagedserve")

# steps of up to this many tokens run compiled: the rows the quantized kernels take
# (quantization/dispatch.py's QUANTIZED_MAX_ROWS), so one graph never holds both of a layer's methods
MAX_COMPILED_TOKENS = 8


class CompiledDecodeForward:
    """The model's forward: compiled for steps of at most ``max_tokens`` tokens, eager otherwise.
    Installed as ``model.forward``."""

    def __init__(self, model: torch.nn.Module, max_tokens: int = MAX_COMPILED_TOKENS):
        self.eager = model.forward
        self.max_tokens = max_tokens
        # traced without the eager forward's inference_mode (dynamo traces no_grad, not inference tensors)
        forward = types.MethodType(_own_code(inspect.unwrap(type(model).forward)), model)
        self.graph = torch.compile(forward, fullgraph=True, dynamic=False,
                                   options={"guard_filter_fn": step_input_guards})
        self.compiled_steps = 0  # how many steps ran the graph (the tests read it)

    def runs_compiled(self, input_ids: torch.Tensor, attn_metadata, inputs_embeds) -> bool:
        return (inputs_embeds is None and isinstance(attn_metadata, PagedAttentionMetadata)
                and input_ids.shape[0] <= self.max_tokens)

    def __call__(self, input_ids, positions, attn_metadata, inputs_embeds=None):
        if not self.runs_compiled(input_ids, attn_metadata, inputs_embeds):
            return self.eager(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)
        self.compiled_steps += 1
        meta = attn_metadata if attn_metadata.max_query_len == 1 else one_row_per_token(attn_metadata, positions)
        with torch.no_grad():
            return self.graph(input_ids, positions, _at_least_two_blocks(meta))

    def capture(self, kv_caches: list[torch.Tensor] = ()) -> float:
        """Compile both graphs now, on dummy steps (slots -1: nothing written); returns the seconds.
        ``kv_caches``: the layers' K and V tensors, whose number of blocks the graphs leave open, so
        that inductor's cache serves an engine with another KV cache size too."""
        for cache in kv_caches:
            torch._dynamo.mark_dynamic(cache, 0)
        start = time.perf_counter()
        with torch.no_grad():
            for num_tokens in (1, 2):
                input_ids, positions, meta = _dummy_decode(num_tokens)
                if num_tokens > 1:  # the second graph: any row count up to max_tokens
                    for tensor in (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables):
                        torch._dynamo.mark_dynamic(tensor, 0, min=2, max=self.max_tokens)
                torch._dynamo.mark_dynamic(meta.block_tables, 1)  # any context length (two blocks or more)
                self.graph(input_ids, positions, meta)
        return time.perf_counter() - start


STEP_INPUTS = ("input_ids", "positions", "attn_metadata")


def step_input_guards(guards) -> list[bool]:
    """Which of dynamo's guards each call checks: those on the step's inputs (their sizes tell the
    two graphs apart) and on shapes, not the thousands on the model's modules, weights and KV
    cache, which stay as they were when the graphs were compiled (no adapters, no reloading)."""
    return [guard.guard_type == "SHAPE_ENV" or _root_name(guard.name) in STEP_INPUTS for guard in guards]


def _root_name(source: str) -> str:
    """``attn_metadata`` of a guard on ``attn_metadata.seq_lens`` (or on ``L['attn_metadata']...``)."""
    return re.match(r"(?:L\[')?(\w*)", source).group(1)


_copies = itertools.count()


def _own_code(function):
    """``function`` with a code object of its own (equal code objects count as one). Dynamo keeps
    compiled graphs per code object and allows eight, so engines sharing the model class's one
    would crowd each other out; this way each engine's graphs are its own, and go with it."""
    code = function.__code__.replace(co_name=f"{function.__code__.co_name}_{next(_copies)}")
    return types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)


def _dummy_decode(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    meta = PagedAttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long),
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32),
        seq_lens=torch.ones(num_tokens, dtype=torch.int32), block_tables=torch.zeros(num_tokens, 2, dtype=torch.int32),
        max_query_len=1, max_seq_len=1)
    return torch.zeros(num_tokens, dtype=torch.long), torch.zeros(num_tokens, dtype=torch.long), meta


def one_row_per_token(meta: PagedAttentionMetadata, positions: torch.Tensor) -> PagedAttentionMetadata:
    """The step as decodes: the token at position ``p`` of a request becomes a row of its own, with
    the request's block table and ``p + 1`` tokens to see (itself and everything before it)."""
    query_lens = meta.query_start_loc.diff()
    num_tokens = positions.shape[0]
    return PagedAttentionMetadata(
        slot_mapping=meta.slot_mapping, query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32),
        seq_lens=(positions + 1).to(torch.int32),
        block_tables=meta.block_tables.repeat_interleave(query_lens, dim=0, output_size=num_tokens),
        max_query_len=1, max_seq_len=meta.max_seq_len)


def _at_least_two_blocks(meta: PagedAttentionMetadata) -> PagedAttentionMetadata:
    """A block table one block wide, padded to two: the graphs were traced for two or more (a size of
    one would be a new graph)."""
    if meta.block_tables.shape[1] >= 2:
        return meta
    tables = torch.nn.functional.pad(meta.block_tables, (0, 1))
    return PagedAttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables,
                                  meta.max_query_len, meta.max_seq_len)


def compile_problem(model: torch.nn.Module, max_tokens: int = MAX_COMPILED_TOKENS) -> str | None:
    """Why ``model``'s decode step cannot be compiled, or None."""
    blocked = [name for name, layer in model.named_modules()
               if isinstance(layer, Linear) and not layer.method.compiles(layer, max_tokens)]
    if blocked:
        return (f"{len(blocked)} linear layers (first: {blocked[0]}) multiply decode rows by weights packed for "
                "oneDNN, which inductor does not compile; a quantized checkpoint (or prepack_linear=False) "
                "compiles")
    return None


def compile_decode_step(model: torch.nn.Module, kv_caches: list[torch.Tensor] = (),
                        max_tokens: int = MAX_COMPILED_TOKENS) -> str | None:
    """Install a ``CompiledDecodeForward`` on ``model`` and compile it now (the time goes to the log);
    where compiling fails (no C++ compiler, say), the eager forward stays: returns why, else None."""
    compiled = CompiledDecodeForward(model, max_tokens)
    try:
        seconds = compiled.capture(kv_caches)
    except Exception as exc:  # inductor needs a C++ compiler at run time, for one
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"compiling failed ({type(exc).__name__}: {(lines[0] if lines else '')[:300]})"
    model.forward = compiled
    logger.info("compiled step: steps of 1 to %d tokens (decodes, verify steps, short chunks) run inductor graphs "
                "(two, compiled in %.1f s); other steps run eagerly", max_tokens, seconds)
    return None
