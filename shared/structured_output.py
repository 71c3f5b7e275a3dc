"""Structured output: a grammar decides which tokens a request may sample next.

A grammar (a JSON schema, a regex, a list of choices, an EBNF or Lark grammar) matched against
the tokenizer's vocabulary answers, in every state, "which tokens keep the text inside the
language?" as a bitmask over the vocabulary. Before sampling, the logits of every other token
become -inf; after sampling, the request's matcher advances by the token it got. Once the
grammar is complete it allows only EOS, and the request ends there.

Building a grammar's matcher takes from microseconds to seconds, so the engine builds it in a
thread pool and schedules a request only once its grammar is ready (the others run
meanwhile); a built grammar is cached per spec, so the next request with the same schema
starts from a copy at once. The front end checks a spec before the request enters the engine
(``check_structured_outputs``): a schema the grammar engine cannot enforce is a
``ValueError`` naming the problem. The matcher always equals the state after the request's
output tokens: it advances in ``Request.append_output_token`` and nowhere else, so preemption
by recompute (which keeps the output tokens and recomputes only their K/V) leaves it right.

The grammar engine is llguidance (vLLM's ``guidance`` backend). vLLM's default, xgrammar, was
tried first and put aside: its JSON grammars let a string with ``maxLength`` carry raw control
characters and a ``pattern`` with a backslash produce an invalid escape (output that is not
JSON), and it ignores keywords it cannot enforce (``uniqueItems``, ``not``, ``if``); llguidance
refuses those with an error, and every output it allowed was valid.

vLLM: ``vllm/sampling_params.py`` (StructuredOutputsParams),
``vllm/v1/structured_output/__init__.py`` (StructuredOutputManager), ``backend_guidance.py``,
``request.py``; the mask is applied in ``vllm/v1/worker/gpu_model_runner.py``
(``apply_grammar_bitmask``), just before the sampler.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from shared.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from shared.request import Request

logger = logging.getLogger("stagedserve")

DEFAULT_CACHE_SIZE = 256  # built grammars kept per engine


# ---- the front end's check: refuse what the engine could not enforce ---------------------------

def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Validate the grammar without a tokenizer (microseconds for usual specs), so that a spec
    the engine could not enforce fails at request time, with a ``ValueError`` naming the problem."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(params))
    if is_error:
        raise ValueError(f"structured_outputs.{params.kind}: {messages[0]}")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The spec as an llguidance grammar (its serialized form; parsing happens when it is built)."""
    import llguidance
    from llguidance import LLMatcher

    kind = params.kind
    field = f"structured_outputs.{kind}"
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _parse_schema(params.json, field)
        whitespace = {"whitespace_flexible": True} if params.any_whitespace else \
            {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        # ``overrides``: a schema's own "x-guidance" options cannot loosen these.
        return LLMatcher.grammar_from_json_schema(no_extra_properties(schema),
                                                  overrides={**whitespace, "lenient": False, "coerce_one_of": False})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None


def _parse_schema(schema: dict | str, field: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field}: not valid JSON ({err.msg} at position {err.pos})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    return schema


def no_extra_properties(schema: Any) -> Any:
    """A copy where an object schema that lists ``properties`` and says nothing about
    ``additionalProperties`` allows no others (what vLLM's default xgrammar backend does, and
    OpenAI's strict mode asks for): the output still validates against the original, and a model
    cannot wander off into invented keys. Inside ``allOf`` nothing changes (the branches'
    properties combine)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for keyword in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(keyword), dict):
            out[keyword] = {name: no_extra_properties(sub) for name, sub in schema[keyword].items()}
    for keyword in ("anyOf", "oneOf", "prefixItems"):
        if isinstance(schema.get(keyword), list):
            out[keyword] = [no_extra_properties(sub) for sub in schema[keyword]]
    for keyword in ("items", "additionalProperties"):
        if keyword in schema:
            out[keyword] = no_extra_properties(schema[keyword])
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


# ---- the engine side ---------------------------------------------------------------------------

class StructuredOutputRequest:
    """One request's grammar state: the built grammar (a future until built) and a matcher that
    has consumed exactly the request's output tokens."""

    def __init__(self, params: StructuredOutputsParams):
        self.params = params
        self.grammar: Future | None = None  # set by StructuredOutputManager.grammar_init
        self.stop_token_ids: frozenset[int] = frozenset()
        self._matcher = None
        self.num_accepted = 0  # output tokens the matcher has consumed

    @property
    def is_ready(self) -> bool:
        """Built, or failed (``error`` says why); a request is scheduled only once ready."""
        assert self.grammar is not None, "grammar_init was never called for this request"
        return self.grammar.done()

    @property
    def error(self) -> BaseException | None:
        return self.grammar.exception() if self.is_ready else None

    def sync(self, output_token_ids: list[int]):
        """Bring the matcher to the state after ``output_token_ids`` and return it.

        After each appended token this consumes just that one; a matcher that is new, or ahead of
        the outputs (they were rolled back), is reset and replays them.
        """
        if self._matcher is None:
            self._matcher = self.grammar.result().deep_copy()  # the cached prototype stays at the start
        if self.num_accepted > len(output_token_ids):
            self._matcher.reset()
            self.num_accepted = 0
        for token in output_token_ids[self.num_accepted:]:
            if not self._matcher.consume_token(token):
                logger.error("grammar rejected token %d: %s", token, self._matcher.get_error())
            self.num_accepted += 1
        return self._matcher

    @property
    def failed(self) -> bool:
        """The matcher hit an error (a resource limit of a pathological grammar): the request
        cannot go on under its grammar."""
        return self._matcher is not None and self._matcher.is_error()

    def is_terminated(self, output_token_ids: list[int]) -> bool:
        """The grammar was complete and the request's last token was its EOS."""
        return (self._matcher is not None and bool(output_token_ids) and self._matcher.is_stopped()
                and output_token_ids[-1] in self.stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, output_token_ids: list[int]) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed after the outputs."""
        matcher = self.sync(output_token_ids)
        if matcher.is_error():  # allow only EOS, so the request ends (as aborted) at once
            bitmask[row] = 0
            for token in self.stop_token_ids:
                bitmask[row, token // 32] |= 1 << (token % 32)
            return
        row_view = bitmask[row]
        matcher.unsafe_compute_mask_ptr(row_view.data_ptr(), row_view.numel() * row_view.element_size())


class StructuredOutputManager:
    """Builds grammars for one tokenizer in a thread pool and caches them per spec.

    ``grammar_init(request)`` returns at once; the request's grammar is a future the scheduler
    polls (``Request.waiting_for_grammar``). Two requests with the same spec share one build,
    even while it is still running; each gets its own copy of the matcher.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int] | tuple[int, ...] = (),
                 max_workers: int | None = None, cache_size: int = DEFAULT_CACHE_SIZE):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the model's (its embedding may be padded past the tokenizer)
        eos = getattr(hf_tokenizer, "eos_token_id", None)
        self.stop_token_ids = frozenset(stop_token_ids or ([] if eos is None else [eos]))
        self.cache_size = cache_size
        workers = max_workers or max(1, (os.cpu_count() or 2) // 2)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._tokenizer = None
        self.num_built = 0  # grammars actually built (cache misses)

    def grammar_init(self, request: Request) -> None:
        """Give a request that asks for structured output its grammar state, and start (or find) the
        build of its grammar; never waits for it."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        so = request.structured_output_request = StructuredOutputRequest(params)
        so.stop_token_ids = self.stop_token_ids
        so.grammar = self.grammar(params)

    def grammar(self, params: StructuredOutputsParams) -> Future:
        """A future of the spec's prototype matcher (at the start state; requests copy it)."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self.executor.submit(self._build, params)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _build(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self._llg_tokenizer(), grammar_text(params), log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        except Exception:
            logger.exception("building a %s grammar failed", params.kind)
            raise
        with self._lock:
            self.num_built += 1
        return matcher

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:  # on a worker thread: a large vocabulary takes about a second
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=sorted(self.stop_token_ids))
            return self._tokenizer

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# ---- the mask, applied to the logits just before sampling --------------------------------------

_BIT = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits [len(requests), vocab]`` with -inf wherever a request's grammar forbids the token.

    Rows of requests without structured output are unchanged; returns ``logits`` itself when
    no request has a grammar.
    """
    rows = [i for i, r in enumerate(requests) if r.structured_output_request is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bitmask = torch.full((len(requests), (vocab + 31) // 32), -1, dtype=torch.int32)  # -1: every token allowed
    for row in rows:
        request = requests[row]
        request.structured_output_request.fill_bitmask(bitmask, row, request.output_token_ids)
    allowed = unpack_bitmask(bitmask, vocab).to(logits.device)
    return logits.masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int32 [rows, words]`` -> ``bool [rows, vocab_size]``: bit ``t % 32`` of word ``t // 32``."""
    bits = (bitmask.unsqueeze(-1) >> _BIT) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
