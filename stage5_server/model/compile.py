"""A compiled step on a CPU: what CUDA graphs are to a GPU.

A step pushes its rows through every layer, and eager PyTorch walks the modules and dispatches about
140 operators a layer from Python; at a few rows that costs more than the arithmetic, and at tens of
rows it is still a fifth of the step. ``CompiledForward`` compiles the whole forward with inductor
(``fullgraph=True``: no graph break) into three graphs, all compiled at start-up by ``capture``:

- **one decode row**: static shapes;
- **decode rows**, 2 up to ``max_num_seqs``, each step padded to the next of ``DECODE_BUCKETS``;
- **mixed steps**, prefill chunks beside decodes, up to ``max_num_batched_tokens`` tokens.

In a graph, attention is one operator a layer: decode rows call ``cpu_kernels``' C++
``decode_step_attention`` (it writes the step's K/V, then attends each row in place); a mixed step
calls ``attention/cpu_attn.py``'s ``paged_step_attention``. The products are operators too: packed
oneDNN weights through ``quantization/packed.py``'s custom operator, the int4 and int8 kernels as
they are, and a layer that switches between them by the number of rows through ``torch.cond``. RMSNorm,
RoPE, SiLU-and-multiply and the residual adds become generated C++ loops.

The decode graph sees only decodes, one query row per sequence. A step whose requests bring a few
tokens each (a speculative verify step, the last short chunk of a prompt) becomes one: the token at
position ``p`` is a decode row over its request's blocks that sees ``p + 1`` tokens
(``one_row_per_token``). The operator writes every row's K/V before any row attends, so each row sees
the tokens before it in the same step: the causal mask of the eager path.

Padding a decode step to a bucket costs little (a decode step's products stream the weights whatever
the rows, a padding row attends one token and writes nothing) and keeps the shapes the graph meets to
a few, each run once at start-up: oneDNN makes its GEMM plan for a row count the first time it meets
it, at start-up rather than under the first requests. A GPU's CUDA graphs, captured per batch size,
need exactly this list. Per call, dynamo checks only its guards on the step's inputs (vLLM drops its
guards too), and each call runs under ``fail_on_recompile``: a step that no graph fits runs eagerly
and is counted (``recompiles_refused``), never compiled while requests wait. Inductor's on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, by default under the temp directory) makes later start-ups quicker.

vLLM: ``vllm/compilation/`` (``backends.py``'s ``VllmBackend``; ``cuda_graph.py``: graphs captured
per batch size at start-up, ``cudagraph_capture_sizes`` in ``vllm/config/compilation.py``;
``wrapper.py``'s ``TorchCompileGuardsStripWrapper``) and ``capture_model`` in
``vllm/v1/worker/gpu_model_runner.py``; its CUDA graphs for uniform decode and verify batches:
``uniform_decode_query_len`` there.
"""

from __future__ import annotations

import bisect
import inspect
import itertools
import logging
import re
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stage2_paged.attention import PagedAttentionMetadata
from stage5_server.model.linear import Linear

logger = logging.getLogger("stagedserve")

# The row counts a decode step is padded to: vLLM's cudagraph_capture_sizes (1, 2, 4, then every 8)
# made coarser, since a CPU graph here serves every size of its range and the list only bounds the
# shapes met. Doubling keeps a padded step within 2x its rows, where the products cost about the same.
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# A step whose requests bring at most this many tokens each runs as decode rows (a verify step of up
# to 7 drafts, a prompt's short last chunk); a longer chunk runs the mixed graph, whose attention
# multiplies blocks of queries at once.
MAX_ROWS_PER_REQUEST = 8
# The mixed graphs' tokens: more than any token budget in use; a larger step runs eagerly.
MAX_MIXED_TOKENS = 1 << 16
RECOMPILE_REFUSED = "fail_on_recompile"  # in the error dynamo raises where a call would compile
# Each graph's size range is fixed, whatever the engine's limits, and named in the cache key (with this
# version): inductor's on-disk cache keeps an entry with the guards of the range it was compiled for, and
# an entry of a narrower range, found for the same graph, would refuse the wider one.
CACHE_KEY_TAG = "stagedserve-compiled-step-2"


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """``DECODE_BUCKETS`` up to ``max_num_seqs``, which ends the list (every decode step of the engine fits
    one), or up to the last of them."""
    top = min(max_num_seqs, DECODE_BUCKETS[-1])
    return tuple(b for b in DECODE_BUCKETS if b < top) + (top,)


def graph_ranges(low: int, high: int, splits: set[int]) -> list[tuple[int, int]]:
    """``[low, high]`` cut after each split point inside it: the row ranges of one kind's graphs."""
    bounds = [low - 1, *sorted(s for s in splits if low <= s < high), high]
    return [(a + 1, b) for a, b in zip(bounds, bounds[1:])]


class CompiledForward:
    """The model's forward, compiled for decode steps (padded to ``decode_buckets(max_num_seqs)``) and
    mixed steps; eager for what no graph serves (image embeddings, a step past ``MAX_MIXED_TOKENS``).
    Installed as ``model.forward``."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, eager_if: Callable[[], bool] | None = None):
        self.eager = model.forward
        self.eager_if = eager_if  # asked before each step: True runs it eagerly (a step with LoRA adapters)
        self.buckets = decode_buckets(max_num_seqs)
        self._pad_sizes = self.buckets + tuple(b for b in DECODE_BUCKETS if b > self.buckets[-1])
        # where a layer computes its products another way (quantization/dispatch.py): no graph spans it
        splits = {s for layer in model.modules() if isinstance(layer, Linear) and (s := layer.method.row_split())}
        self.decode_ranges = [(1, 1), *graph_ranges(2, DECODE_BUCKETS[-1], splits)]
        self.mixed_ranges = graph_ranges(MAX_ROWS_PER_REQUEST + 1, MAX_MIXED_TOKENS, splits)
        options = {"guard_filter_fn": step_input_guards}
        # traced without the eager forward's inference_mode (dynamo traces no_grad, not inference tensors);
        # each kind on its own code object, so a step is never matched against the other kind's guards
        forward = inspect.unwrap(type(model).forward)
        self.decode_graph, self.mixed_graph = (
            torch.compile(types.MethodType(_own_code(forward), model), fullgraph=True, dynamic=False, options=options)
            for _ in range(2))
        self.compiled_steps = 0  # steps that ran a graph (the tests read these)
        self.recompiles_refused = 0  # steps no graph fitted, run eagerly instead of compiling one

    def __call__(self, input_ids, positions, attn_metadata, inputs_embeds=None):
        if inputs_embeds is not None or not isinstance(attn_metadata, PagedAttentionMetadata) or (
                self.eager_if is not None and self.eager_if()):
            return self.eager(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)
        num_tokens = input_ids.shape[0]
        if attn_metadata.max_query_len <= MAX_ROWS_PER_REQUEST and num_tokens <= DECODE_BUCKETS[-1]:
            meta = attn_metadata if attn_metadata.max_query_len == 1 else one_row_per_token(attn_metadata, positions)
            rows = min(self._pad_sizes[bisect.bisect_left(self._pad_sizes, num_tokens)],
                       next(high for low, high in self.decode_ranges if low <= num_tokens <= high))
            graph, inputs = self.decode_graph, padded_decode_rows(input_ids, positions, meta, rows)
        elif num_tokens <= MAX_MIXED_TOKENS:
            graph, inputs = self.mixed_graph, mixed_step(input_ids, positions, attn_metadata)
        else:
            return self.eager(input_ids, positions, attn_metadata)
        try:
            with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
                hidden = graph(*inputs)
        except RuntimeError as exc:
            if RECOMPILE_REFUSED not in str(exc):
                raise
            self.recompiles_refused += 1
            logger.warning("compiled step: no graph fits a step of %d tokens; it runs eagerly (%s)", num_tokens,
                           " ".join(line.strip() for line in str(exc).splitlines()[1:])[:400])
            return self.eager(input_ids, positions, attn_metadata)
        self.compiled_steps += 1
        return hidden[:num_tokens]

    def capture(self, kv_caches: list[torch.Tensor] = ()) -> float:
        """Compile every graph now, on dummy steps (slots -1: nothing written), then run each decode
        bucket once; returns the seconds. ``kv_caches``: the layers' K and V tensors, whose number of
        blocks the graphs leave open, so that inductor's cache serves another KV cache size too."""
        for cache in kv_caches:
            torch._dynamo.mark_dynamic(cache, 0)
        start = time.perf_counter()
        with torch.no_grad():
            for low, high in self.decode_ranges:
                input_ids, positions, meta = _dummy_decode(low)
                if high > low:
                    for tensor in (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables):
                        torch._dynamo.mark_dynamic(tensor, 0, min=low, max=high)
                    torch._dynamo.mark_dynamic(meta.query_start_loc, 0, min=low + 1, max=high + 1)
                    torch._dynamo.mark_dynamic(meta.block_tables, 1)  # any context (two blocks or more)
                with torch.compiler.config.patch(cache_key_tag=f"{CACHE_KEY_TAG}-decode-{low}-{high}"):
                    self.decode_graph(input_ids, positions, meta)
            for low, high in self.mixed_ranges:
                input_ids, positions, meta = mixed_step(*_dummy_mixed(low))
                for tensor in (input_ids, positions, meta.slot_mapping):
                    torch._dynamo.mark_dynamic(tensor, 0, min=low, max=high)
                for tensor in (meta.query_start_loc, meta.seq_lens, meta.block_tables):  # two sequences or more
                    torch._dynamo.mark_dynamic(tensor, 0)
                torch._dynamo.mark_dynamic(meta.block_tables, 1)
                with torch.compiler.config.patch(cache_key_tag=f"{CACHE_KEY_TAG}-mixed-{low}-{high}"):
                    self.mixed_graph(input_ids, positions, meta)
            with torch.compiler.set_stance("fail_on_recompile"):
                for rows in self.buckets[1:]:  # oneDNN's plans for each bucket's shapes, made now
                    self.decode_graph(*_dummy_decode(rows))
        return time.perf_counter() - start

    def describe(self) -> str:
        ranges = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in self.decode_ranges)
        mixed = ", ".join(f"{a}-{b}" for a, b in self.mixed_ranges)
        return (f"{len(self.decode_ranges) + len(self.mixed_ranges)} graphs: decode rows {ranges} (padded to "
                f"{list(self.buckets)}), mixed steps of {mixed} tokens")


STEP_INPUTS = ("input_ids", "positions", "attn_metadata")


def step_input_guards(guards) -> list[bool]:
    """Which of dynamo's guards each call checks: those on the step's inputs (their sizes tell the
    graphs apart) and on shapes, not the thousands on the model's modules, weights and KV cache, which
    stay as they were when the graphs were compiled (no adapters, no reloading)."""
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


def _dummy_decode(num_rows: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    meta = PagedAttentionMetadata(
        slot_mapping=torch.full((num_rows,), -1, dtype=torch.long),
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32),
        seq_lens=torch.ones(num_rows, dtype=torch.int32), block_tables=torch.zeros(num_rows, 2, dtype=torch.int32),
        max_query_len=1, max_seq_len=1)
    return torch.zeros(num_rows, dtype=torch.long), torch.zeros(num_rows, dtype=torch.long), meta


def _dummy_mixed(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """A prompt of ``num_tokens - 1`` tokens beside one decode, writing nothing."""
    meta = PagedAttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long),
        query_start_loc=torch.tensor([0, num_tokens - 1, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens - 1, 1], dtype=torch.int32),
        block_tables=torch.zeros(2, 2, dtype=torch.int32), max_query_len=num_tokens - 1, max_seq_len=num_tokens - 1)
    return torch.zeros(num_tokens, dtype=torch.long), torch.arange(num_tokens), meta


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


def padded_decode_rows(input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
                       rows: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """Decode rows padded to ``rows``: a padding row writes nothing (slot -1) and sees one token of
    block 0; block tables at least two blocks wide (a width of one would be a graph of its own)."""
    pad = rows - input_ids.shape[0]
    tables = meta.block_tables
    if pad or tables.shape[1] < 2:
        tables = F.pad(tables, (0, max(0, 2 - tables.shape[1]), 0, pad))
    if pad:
        input_ids, positions = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad))
        meta = PagedAttentionMetadata(
            F.pad(meta.slot_mapping, (0, pad), value=-1), torch.arange(rows + 1, dtype=torch.int32),
            F.pad(meta.seq_lens, (0, pad), value=1), tables, max_query_len=1, max_seq_len=meta.max_seq_len)
    elif tables is not meta.block_tables:
        meta = PagedAttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, tables, 1,
                                      meta.max_seq_len)
    return input_ids, positions, meta


def mixed_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata
               ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """A step's inputs as the mixed graph takes them: at least two sequences (a lone prompt gets an
    empty one beside it) and two blocks, so that no size is 1, which would be a graph of its own; the
    step's Python numbers fixed, so that no guard reads them (the operator plans from the tensors)."""
    tables, starts, seq_lens = meta.block_tables, meta.query_start_loc, meta.seq_lens
    if seq_lens.shape[0] < 2:
        starts, seq_lens = torch.cat([starts, starts[-1:]]), F.pad(seq_lens, (0, 1))
        tables = F.pad(tables, (0, 0, 0, 1))
    if tables.shape[1] < 2:
        tables = F.pad(tables, (0, 2 - tables.shape[1]))
    return input_ids, positions, PagedAttentionMetadata(meta.slot_mapping, starts, seq_lens, tables,
                                                        max_query_len=2, max_seq_len=0)


def compile_step(model: torch.nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 eager_if: Callable[[], bool] | None = None) -> str | None:
    """Install a ``CompiledForward`` on ``model`` and compile it now (the time goes to the log); where
    compiling fails (no C++ compiler, say), the eager forward stays: returns why, else None."""
    compiled = CompiledForward(model, max_num_seqs, eager_if)
    try:
        seconds = compiled.capture(kv_caches)
    except Exception as exc:  # inductor needs a C++ compiler at run time, for one
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"compiling failed ({type(exc).__name__}: {(lines[0] if lines else '')[:300]})"
    model.forward = compiled
    logger.info("compiled step: %s; compiled in %.1f s", compiled.describe(), seconds)
    return None
