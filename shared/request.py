"""A request's state inside an engine, and the rules that end it.

Every stage tracks the same things per request: prompt and output token ids, how many of
those tokens already have K/V in the cache (``num_computed_tokens``), a lifecycle status
and a timeline. Stop token ids, EOS and ``max_tokens`` are checked here, right after a
token is sampled; stop *strings* need text, so the front end checks those. A request with
structured output also carries a constraint on what it may sample: an ``OutputConstraint``, which
the grammar manager attaches (``shared/structured_output.py``) and every output token advances;
until it is ready the request waits. This module knows only the protocol, not the grammars.

vLLM: ``vllm/v1/request.py`` (Request, RequestStatus) and ``vllm/v1/core/sched/utils.py``
(check_stop).
"""

from __future__ import annotations

import enum
import time
from typing import Any, Protocol

import torch

from shared.metrics import RequestTimeline
from shared.outputs import Logprob
from shared.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class OutputConstraint(Protocol):
    """What a request's output must keep to (a structured-output grammar): built in the background (``is_ready``,
    ``error``), advanced by every output token (``sync``), broken (``failed``) or complete (``is_terminated``).
    ``grammar`` is None on a front end's copy, which only reads the outputs."""

    grammar: Any

    @property
    def is_ready(self) -> bool: ...
    @property
    def error(self) -> BaseException | None: ...
    @property
    def failed(self) -> bool: ...
    def sync(self, output_token_ids: list[int]) -> Any: ...
    def is_terminated(self, output_token_ids: list[int]) -> bool: ...


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), bad_words_token_ids: list[list[int]] | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.eos_token_ids = tuple(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are already in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (stage4)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] = []
        # Entry i: prompt token i's logprob and top alternatives; the first token has none (None).
        wants_prompt_logprobs = sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: list[dict[int, Logprob] | None] = [None] if wants_prompt_logprobs else []
        self.bad_words_token_ids = [list(w) for w in bad_words_token_ids or ()]  # the output must not end with one
        self.timeline = RequestTimeline(arrival=self.arrival_time)
        seed = sampling_params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        # Its grammar, when it asks for structured output: attached by ``StructuredOutputManager.grammar_init``.
        self.structured_output_request: OutputConstraint | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def waiting_for_grammar(self) -> bool:
        """Its structured-output grammar is still compiling: a scheduler passes it over for now."""
        return self.structured_output_request is not None and not self.structured_output_request.is_ready

    @property
    def grammar_failed(self) -> bool:
        """Its grammar failed to compile (the front end checked the spec, so this is rare): a
        scheduler finishes it as aborted instead of running it."""
        so = self.structured_output_request
        return so is not None and so.is_ready and so.error is not None

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A request that wants prompt logprobs needs the logits of every prompt position, which
        only a full prefill computes: a prefix-cache hit would skip them (vLLM does the same)."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def stop_token_ids_for_min_tokens(self) -> set[int]:
        """The ids ``min_tokens`` holds back: stop tokens and EOS (even with ``ignore_eos``, as in vLLM)."""
        return {*self.sampling_params.stop_token_ids, *self.eos_token_ids}

    def max_output_tokens(self, max_model_len: int) -> int:
        room = max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    def append_output_token(self, token_id: int, now: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.timeline.token_times.append(time.monotonic() if now is None else now)
        if self.structured_output_request is not None and self.structured_output_request.grammar is not None:
            self.structured_output_request.sync(self.output_token_ids)  # a front end's copy has no grammar

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finish ``request`` if its newest token ends it; return whether it finished."""
    output = request.output_token_ids
    token = output[-1]
    params = request.sampling_params
    grammar = request.structured_output_request
    may_stop = len(output) >= params.min_tokens  # before min_tokens only the length ends it
    if grammar is not None and grammar.failed:
        request.status = RequestStatus.FINISHED_ABORTED  # its grammar hit a resource limit
    elif may_stop and not params.ignore_eos and token in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
    elif may_stop and token in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = token
    elif grammar is not None and grammar.is_terminated(request.output_token_ids):
        request.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (also under ignore_eos)
    elif (params.max_tokens is not None and len(output) >= params.max_tokens) \
            or len(request.all_token_ids) >= max_model_len:  # ``max_output_tokens`` reached
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    else:
        return False
    return True
