"""A compiled step on a CPU: what CUDA graphs are to a GPU.

A step pushes its rows through every layer, and eager PyTorch walks the modules and dispatches about
140 operators a layer from Python: at a few rows that costs more than the arithmetic, and at tens of rows
it is still a large share of the step. ``CompiledForward`` compiles the whole forward with inductor
(``fullgraph=True``: no graph break) into graphs of two kinds, compiled by ``capture`` before the first
step that runs them:

- **decode rows**, steps of up to ``MAX_DECODE_ROWS`` tokens (a decode batch, a speculative verify step,
  a prompt's short last chunk): one graph for one row, one for 2 to 8 rows. Attention is ``cpu_kernels``'
  C++ ``decode_step_attention``, one operator a layer that writes the step's K/V, then attends each row in
  place. A step whose requests bring several tokens becomes decode rows first: the token at position
  ``p`` is a row over its request's blocks that sees ``p + 1`` tokens (``one_row_per_token``); the
  operator writes every row's K/V before any row attends, which is the causal mask of the eager path.
- **any step** of more tokens: larger decode batches, prompts alone or beside decodes. Attention is
  ``attention/cpu_attn.py``'s ``paged_step_attention``, the eager path (the C++ operator for the
  decodes, one SDPA call for the prompts) as one custom operator a layer.

A decode step is padded to the next of ``DECODE_BUCKETS`` (vLLM's ``cudagraph_capture_sizes``): padding
rows write nothing (slot -1) and attend one token, and a decode step's products cost about the same at
twice the rows, since they stream the weights either way. The list keeps the shapes a graph meets to a
few, each run once by ``capture``; a GPU's CUDA graphs, captured per batch size, need exactly this list.

The products are operators in the graphs: packed oneDNN weights through ``cpu_kernels``'
``packed_linear``, the int4 and int8 kernels as they are. A layer that picks its method by the number of
rows (``quantization/dispatch.py``) says where (``row_split``), and no graph's range of rows crosses
that point, so each graph holds one method per layer.

Per call, dynamo checks only its guards on the step's inputs (vLLM drops its guards too), and each call
runs under ``fail_on_recompile``: a step that no graph fits runs eagerly and is counted
(``recompiles_refused``), never compiled while requests wait. Inductor's on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, by default under the temp directory) makes later captures quicker.
``compile_step`` captures at start-up, or in a thread while the first steps run eagerly.

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
import threading
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
MAX_DECODE_ROWS = 8  # steps of up to this many tokens run as decode rows (the C++ decode operator)
MAX_STEP_TOKENS = 1 << 16  # more than any token budget in use; a larger step runs eagerly
RECOMPILE_REFUSED = "fail_on_recompile"  # in the error dynamo raises where a call would compile
# Each graph's size range is fixed, whatever the engine's limits, and named in the cache key (with this
# version): inductor's on-disk cache keeps an entry with the guards of the range it was compiled for, and
# an entry of a narrower range, found for the same graph, would refuse the wider one.
CACHE_KEY_TAG = "stagedserve-compiled-step-3"


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """``DECODE_BUCKETS`` up to ``max_num_seqs``, which ends the list (every decode step of the engine fits
    one), or up to the last of them."""
    top = min(max_num_seqs, DECODE_BUCKETS[-1])
    return tuple(b for b in DECODE_BUCKETS if b < top) + (top,)


def graph_ranges(low: int, high: int, splits: set[int]) -> list[tuple[int, int]]:
    """``[low, high]`` cut after each split point inside it: the ranges of one kind's graphs."""
    bounds = [low - 1, *sorted(s for s in splits if low <= s < high), high]
    return [(a + 1, b) for a, b in zip(bounds, bounds[1:])]


class CompiledForward:
    """The model's forward, compiled for every step that has token ids (``max_num_seqs``: the decode
    buckets). Installed as ``model.forward``; ``eager_if``, asked before each step, sends a step to the
    eager forward (a step with LoRA adapters: the graphs were traced without them)."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, eager_if: Callable[[], bool] | None = None):
        self.eager = model.forward
        self.eager_if = eager_if
        self.buckets = decode_buckets(max_num_seqs)
        # where a layer computes its products another way (quantization/dispatch.py): no graph spans it
        splits = {s for layer in model.modules() if isinstance(layer, Linear) and (s := layer.method.row_split())}
        self.decode_ranges = [(1, 1), *graph_ranges(2, MAX_DECODE_ROWS, splits)]
        self.step_ranges = graph_ranges(MAX_DECODE_ROWS + 1, MAX_STEP_TOKENS, splits)
        options = {"guard_filter_fn": step_input_guards}
        # traced without the eager forward's inference_mode (dynamo traces no_grad, not inference tensors);
        # each kind on its own code object, so a step is never matched against the other kind's guards
        forward = inspect.unwrap(type(model).forward)
        self.decode_graph, self.step_graph = (
            torch.compile(types.MethodType(_own_code(forward), model), fullgraph=True, dynamic=False, options=options)
            for _ in range(2))
        self.compiled_steps = 0  # steps that ran a graph (the tests read these)
        self.recompiles_refused = 0  # steps no graph fitted, run eagerly instead of compiling one

    def __call__(self, input_ids, positions, attn_metadata, inputs_embeds=None):
        if inputs_embeds is not None or not isinstance(attn_metadata, PagedAttentionMetadata) or (
                self.eager_if is not None and self.eager_if()):
            return self.eager(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)
        num_tokens = input_ids.shape[0]
        if num_tokens <= MAX_DECODE_ROWS:
            meta = attn_metadata if attn_metadata.max_query_len == 1 else one_row_per_token(attn_metadata, positions)
            graph, inputs = self.decode_graph, padded_decode_rows(input_ids, positions, meta, self._rows(num_tokens))
        elif num_tokens <= MAX_STEP_TOKENS:
            rows = self._rows(num_tokens) if attn_metadata.max_query_len == 1 else num_tokens
            graph, inputs = self.step_graph, step_inputs(input_ids, positions, attn_metadata, rows)
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

    def _rows(self, num_tokens: int) -> int:
        """The rows a decode step of ``num_tokens`` runs: its bucket, within its graph's range."""
        index = bisect.bisect_left(self.buckets, num_tokens)
        bucket = self.buckets[index] if index < len(self.buckets) else num_tokens
        return min(bucket, next(high for low, high in self.decode_ranges + self.step_ranges
                                if low <= num_tokens <= high))

    def capture(self, kv_caches: list[torch.Tensor] = ()) -> float:
        """Compile every graph on dummy steps (slots -1: nothing written), then run each decode bucket
        once; returns the seconds. ``kv_caches``: the layers' K and V tensors, whose number of blocks the
        graphs leave open, so that inductor's cache serves another KV cache size too."""
        for cache in kv_caches:
            torch._dynamo.mark_dynamic(cache, 0)
        start = time.perf_counter()
        with torch.no_grad():
            for low, high in self.decode_ranges:
                input_ids, positions, meta = padded_decode_rows(*_dummy_decode(low), low)
                if high > low:
                    for tensor in (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables):
                        torch._dynamo.mark_dynamic(tensor, 0, min=low, max=high)
                    torch._dynamo.mark_dynamic(meta.query_start_loc, 0, min=low + 1, max=high + 1)
                torch._dynamo.mark_dynamic(meta.block_tables, 1)  # any context (two blocks or more)
                with torch.compiler.config.patch(cache_key_tag=f"{CACHE_KEY_TAG}-decode-{low}-{high}"):
                    self.decode_graph(input_ids, positions, meta)
            for low, high in self.step_ranges:
                input_ids, positions, meta = step_inputs(*_dummy_step(low), low)
                for tensor in (input_ids, positions, meta.slot_mapping):
                    torch._dynamo.mark_dynamic(tensor, 0, min=low, max=high)
                for tensor in (meta.query_start_loc, meta.seq_lens, meta.block_tables):  # two sequences or more
                    torch._dynamo.mark_dynamic(tensor, 0)
                torch._dynamo.mark_dynamic(meta.block_tables, 1)
                with torch.compiler.config.patch(cache_key_tag=f"{CACHE_KEY_TAG}-step-{low}-{high}"):
                    self.step_graph(input_ids, positions, meta)
            with torch.compiler.set_stance("fail_on_recompile"):
                for rows in self.buckets[1:]:  # each bucket's shapes met once, now
                    input_ids, positions, meta = _dummy_decode(rows)
                    if rows <= MAX_DECODE_ROWS:
                        self.decode_graph(*padded_decode_rows(input_ids, positions, meta, rows))
                    else:
                        self.step_graph(*step_inputs(input_ids, positions, meta, rows))
        return time.perf_counter() - start

    def describe(self) -> str:
        def spans(ranges):
            return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ranges)

        return (f"{len(self.decode_ranges) + len(self.step_ranges)} graphs: decode rows {spans(self.decode_ranges)}, "
                f"any step of {spans(self.step_ranges)} tokens; decode steps padded to {list(self.buckets)}")


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


def _dummy_step(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
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


def step_inputs(input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
                rows: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """A step as the any-step graph takes it: a decode step padded to ``rows`` tokens with one-token
    sequences that write nothing (slot -1); at least two sequences (a lone prompt gets an empty one
    beside it) and two blocks, so that no size is 1, which would be a graph of its own; the step's
    Python numbers set to 0, so that no guard reads them (the operator plans from the tensors)."""
    tables, starts, seq_lens, slots = meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.slot_mapping
    pad = rows - input_ids.shape[0]
    if pad:  # one token each
        input_ids, positions, slots = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)), \
            F.pad(slots, (0, pad), value=-1)
        starts = torch.cat([starts, starts[-1] + torch.arange(1, pad + 1, dtype=starts.dtype)])
        seq_lens, tables = F.pad(seq_lens, (0, pad), value=1), F.pad(tables, (0, 0, 0, pad))
    if seq_lens.shape[0] < 2:
        starts, seq_lens = torch.cat([starts, starts[-1:]]), F.pad(seq_lens, (0, 1))
        tables = F.pad(tables, (0, 0, 0, 1))
    if tables.shape[1] < 2:
        tables = F.pad(tables, (0, 2 - tables.shape[1]))
    return input_ids, positions, PagedAttentionMetadata(slots, starts, seq_lens, tables, max_query_len=0,
                                                        max_seq_len=0)


def compile_step(model: torch.nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 eager_if: Callable[[], bool] | None = None, background: bool = False) -> str | None:
    """Install a ``CompiledForward`` on ``model`` once its graphs are compiled: now, or (``background``)
    in a thread while the steps before run eagerly; the time goes to the log. Where compiling fails (no
    C++ compiler, say), the eager forward stays: returns why (logs it, in the background), else None."""
    compiled = CompiledForward(model, max_num_seqs, eager_if)

    def capture() -> str | None:
        try:
            seconds = compiled.capture(kv_caches)
        except Exception as exc:  # inductor needs a C++ compiler at run time, for one
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            return f"compiling failed ({type(exc).__name__}: {(lines[0] if lines else '')[:300]})"
        model.forward = compiled  # the next step runs it
        logger.info("compiled step: %s; compiled in %.1f s", compiled.describe(), seconds)
        return None

    if not background:
        return capture()

    def capture_and_say() -> None:
        problem = capture()
        if problem is not None:
            logger.warning("every step runs eagerly: %s", problem)

    logger.info("compiled step: compiling in the background; steps run eagerly until it is done")
    threading.Thread(target=capture_and_say, name="stagedserve-compile", daemon=True).start()
    return None
