"""From engine requests to user-facing outputs: detokenize, apply stop strings, merge ``n`` children.

Stop strings are a property of text, not tokens, so they are found here, after
detokenization, and the engine is told to finish the request (as vLLM's
``vllm/v1/engine/output_processor.py`` and ``detokenizer.py`` do). The rules are vLLM's:

- the text is cut before the stop string, or after it with ``include_stop_str_in_output``;
- a request that a stop token (EOS or ``stop_token_ids``) ended does not show that token's
  text, unless ``include_stop_str_in_output``; its id stays in ``token_ids``;
- text made by the first ``min_tokens`` tokens cannot hold a stop string;
- a request with ``detokenize=False`` (vLLM's field) gets token ids and no text: nothing is decoded;
- while a request runs, its text holds back the last ``len(longest stop) - 1`` characters,
  which may yet turn out to start a stop string: text once shown is never taken back.

The processor keeps a small ``RequestState`` per engine request, fed by ``OutputDelta``s (what a
step added to the request), never a copy of the engine's ``Request``. Each output carries everything
so far; a request added with ``final_only`` (``LLM.generate``) gets one output, when it finishes, and
is detokenized only then unless a stop string must be watched for. A child of a parallel-sampling
request (``n > 1``) is merged into its parent's output (``shared/parallel_sampling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from shared.metrics import RequestTimeline
from shared.outputs import CompletionOutput, Logprob, RequestOutput
from shared.parallel_sampling import ParentRequest
from shared.request import Request
from shared.sampling_params import SamplingParams
from shared.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class OutputDelta:
    """One engine request after a step: its new tokens and how it stands now."""

    request_id: str
    new_token_ids: list[int]
    new_token_times: list[float]
    new_logprobs: list[dict[int, Logprob]] | None  # one entry per new token, when logprobs were asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # once, with the first token, when asked for
    finish_reason: str | None  # "stop" | "length" | "abort", None while running
    stop_reason: int | str | None
    num_cached_tokens: int
    num_preemptions: int
    queued: float | None  # when the core took the request in
    first_scheduled: float | None
    finished: float | None

    @classmethod
    def from_request(cls, request: Request, num_sent: int) -> OutputDelta:
        """The tokens after the first ``num_sent``, and the request's state."""
        timeline, params = request.timeline, request.sampling_params
        # Prefill scores the whole prompt before the first token is sampled: send them with that token.
        first = num_sent == 0 and request.num_output_tokens > 0 and params.prompt_logprobs is not None
        return cls(request.request_id, request.output_token_ids[num_sent:], timeline.token_times[num_sent:],
                   request.logprobs[num_sent:] if params.logprobs is not None else None,
                   request.prompt_logprobs if first else None, request.status.finish_reason, request.stop_reason,
                   request.num_cached_tokens, request.num_preemptions, timeline.queued, timeline.first_scheduled,
                   timeline.finished)


class OutputText:
    """One request's text under the rules above: ``update`` with its output tokens so far, ``visible``
    what may be shown now."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.num_seen = 0  # output tokens already detokenized
        self.stop_string: str | None = None  # the stop string that ended the text
        self.no_stop_before = 0  # text made by the first min_tokens tokens holds no stop string

    def update(self, token_ids: list[int], finished: bool, ended_by_stop_token: bool) -> str | None:
        """Detokenize the tokens of ``token_ids`` (all output tokens so far) not seen yet; return the
        stop string found in the new text, if any (the text is cut there)."""
        params = self.params
        new_ids = token_ids[self.num_seen:]
        crossed_min_tokens = self.num_seen <= params.min_tokens < len(token_ids)
        self.num_seen = len(token_ids)
        if self.stop_string is not None or not params.detokenize:
            return None
        if crossed_min_tokens and params.min_tokens:
            self.no_stop_before = len(self.tokenizer.decode(token_ids[:params.min_tokens]))
        shown_ids = token_ids
        if ended_by_stop_token and not params.include_stop_str_in_output:
            new_ids, shown_ids = new_ids[:-1], shown_ids[:-1]
        before = len(self.detokenizer.text)
        if finished:  # the whole text at once: nothing comes after it
            self.detokenizer.text = self.tokenizer.decode(shown_ids)
        else:
            self.detokenizer.add_tokens(new_ids)
        if not params.stop or len(token_ids) <= params.min_tokens:
            return None
        text = self.detokenizer.text
        search_from = max(before, self.no_stop_before) - max(map(len, params.stop))
        hit = _find_stop(text, params.stop, max(0, search_from))
        if hit is None:
            return None
        index, stop = hit
        self.detokenizer.text = text[:index + len(stop)] if params.include_stop_str_in_output else text[:index]
        self.stop_string = stop
        return stop

    def visible(self, finished: bool) -> str:
        """The text so far; while running, less the last characters that may yet start a stop string."""
        text = self.detokenizer.text
        hold_back = max(map(len, self.params.stop), default=1) - 1
        if not finished and hold_back and not self.params.include_stop_str_in_output:
            text = text[:max(0, len(text) - hold_back)]
        return text


@dataclass
class RequestState:
    """One engine request as the front end sees it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: OutputText
    timeline: RequestTimeline
    final_only: bool = False  # one output, when it finishes
    parent: ParentRequest | None = None
    index: int = 0  # the child's index within its parent
    caller_id: str = ""  # the id its caller knows: its own, or its parent's
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    output_type: ClassVar[type[RequestOutput]] = RequestOutput  # what ``output`` makes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def waits_for_finish(self) -> bool:
        """A ``final_only`` request with no stop string to watch for needs its tokens only once it finishes."""
        return self.final_only and not self.text.params.stop

    def update(self, delta: OutputDelta) -> bool:
        """Take in one step's delta; return True when a stop string just ended the request."""
        self.token_ids += delta.new_token_ids
        t = self.timeline
        t.token_times += delta.new_token_times
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        self.num_cached_tokens, self.num_preemptions = delta.num_cached_tokens, delta.num_preemptions
        t.queued, t.first_scheduled, t.finished = delta.queued, delta.first_scheduled, delta.finished
        was_finished = self.finished
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        if self.waits_for_finish() and not self.finished:
            return False  # its text is needed only at the end
        by_stop_token = self.finish_reason == "stop" and not isinstance(self.stop_reason, str)
        stop = self.text.update(self.token_ids, self.finished, by_stop_token)
        if stop is None or was_finished:
            return False
        finished_by_engine = self.finished
        self.finish_reason, self.stop_reason = "stop", stop
        if finished_by_engine:
            return False
        t.finished = t.token_times[-1]
        return True

    def make_output(self) -> RequestOutput | None:
        """This request's output, or None when there is nothing to send (a ``final_only`` request still running)."""
        if self.final_only and not self.finished:
            return None
        return self.output(self.text.visible(self.finished), 0, len(self.token_ids))

    def output(self, text: str, start: int, end: int) -> RequestOutput:
        """An output with ``text`` and output tokens ``start .. end``."""
        completion = CompletionOutput(self.index, text, self.token_ids[start:end], self.finish_reason,
                                      self.stop_reason, None if self.logprobs is None else self.logprobs[start:end])
        return self.output_type(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finished=self.finished, timeline=self.timeline,
                             num_cached_tokens=self.num_cached_tokens, num_preemptions=self.num_preemptions,
                             prompt_logprobs=self.prompt_logprobs)


@dataclass
class OutputProcessorOutput:
    outputs: list[RequestOutput] = field(default_factory=list)  # for the callers, by the ids they know
    reqs_to_abort: list[str] = field(default_factory=list)  # a stop string ended them: the engine must stop them


class OutputProcessor:
    """The requests in flight, by engine request id, and by the id their caller knows."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}  # by engine request id
        self.engine_ids: dict[str, list[str]] = {}  # by the caller's id: its engine requests still running

    def __len__(self) -> int:
        return len(self.engine_ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.engine_ids or request_id in self.request_states

    def num_output_tokens(self, request_id: str) -> int:
        return len(self.request_states[request_id].token_ids)

    def wants_delta(self, request_id: str, finished: bool) -> bool:
        """Whether this step's delta of engine request ``request_id`` is wanted: not for one it does not track,
        and for one that waits for its finish, only then (its next delta carries every token since)."""
        state = self.request_states.get(request_id)
        return state is not None and (finished or not state.waits_for_finish())

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, *, final_only: bool = False, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        """Track an engine request (a child ``index`` of ``parent``, when ``n > 1``)."""
        self._track(RequestState(request_id, prompt, prompt_token_ids, OutputText(self.tokenizer, params),
                                 RequestTimeline(arrival=arrival_time), final_only, parent, index,
                                 request_id if parent is None else parent.request_id,
                                 logprobs=[] if params.logprobs is not None else None))

    def _track(self, state: RequestState) -> None:
        self.request_states[state.request_id] = state
        self.engine_ids.setdefault(state.caller_id, []).append(state.request_id)

    def process_outputs(self, deltas: list[OutputDelta]) -> OutputProcessorOutput:
        """The outputs for the callers, and what the engine must be told. A request that finished is dropped
        here (its caller's id once all its engine requests have)."""
        result = self._result()
        for delta in deltas:
            state = self.request_states.get(delta.request_id)
            if state is not None:  # else aborted, or ended by a stop string, while the engine was stepping
                self._process(state, delta, result)
        return result

    def _result(self) -> OutputProcessorOutput:
        return OutputProcessorOutput()

    def _process(self, state: RequestState, delta: OutputDelta, result: OutputProcessorOutput) -> None:
        if state.update(delta):
            result.reqs_to_abort.append(state.request_id)
        output = state.make_output()
        if state.finished:
            self._finished(state)
        if state.parent is not None and output is not None:
            output = self._merge(state, output)
        if output is not None:
            result.outputs.append(output)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (a caller's id, or any one of its engine ids, forgets all of them); return their
        engine ids still running."""
        engine_ids = []
        for request_id in request_ids:
            state = self.request_states.get(request_id)
            for engine_id in self.engine_ids.pop(request_id if state is None else state.caller_id, ()):
                del self.request_states[engine_id]
                engine_ids.append(engine_id)
        return engine_ids

    def _finished(self, state: RequestState) -> None:
        del self.request_states[state.request_id]
        running = self.engine_ids[state.caller_id]
        running.remove(state.request_id)
        if not running:
            del self.engine_ids[state.caller_id]

    def _merge(self, state: RequestState, output: RequestOutput) -> RequestOutput | None:
        """A child's output as its parent's: every child's latest, or (``final_only``) every child's whole
        output once all finished."""
        merged = state.parent.merge(state.index, output)
        return merged if merged.finished or not state.final_only else None


def _find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        i = text.find(stop, search_from)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
