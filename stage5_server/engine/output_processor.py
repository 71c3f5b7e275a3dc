"""The front end's output processor: stage 4's (detokenize, stop strings, merge ``n`` children), plus what
serving needs.

- **Outputs as the caller asked** (vLLM's ``RequestOutputKind``): ``CUMULATIVE`` (everything so far),
  ``DELTA`` (only what is new: the server streams these as they are) or ``FINAL_ONLY``; each goes to
  its request's queue (the server's stream), with the queue it belongs to.
- **Several tokens in one step** (speculative decoding): with stop strings they are taken one at a
  time, so that a stop string ends the output at the token that completed it, as plain decoding does.
- **Logprob tokens decoded** (``decode_logprobs``: ``Logprob.decoded_token``, what the API returns).
- **A pooling request's vector** (``RequestOutput.pooled``), with its one, final output.
- **A failure confined to its request** (``contain_failures``: a Rust panic while detokenizing fails
  that request only), and each engine request's whole output once it finishes, for the stat loggers
  (a ``FINAL_ONLY`` child's only with its siblings').

vLLM: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``, ``RequestState``, ``RequestOutputKind``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from shared.metrics import RequestTimeline
from shared.output_processor import OutputDelta, OutputProcessorOutput, OutputText
from shared.output_processor import OutputProcessor as _OutputProcessor
from shared.output_processor import RequestState as _RequestState
from shared.outputs import RequestOutput as _RequestOutput
from shared.parallel_sampling import ParentRequest
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class RequestOutput(_RequestOutput):
    pooled: list[float] | None = None  # a pooling model's vector for the prompt (pooling/)


def one_token_deltas(delta: OutputDelta) -> list[OutputDelta]:
    """``delta`` as one delta per new token; only the last carries how the request finished."""
    last = len(delta.new_token_ids) - 1
    return [replace(delta, new_token_ids=[token], new_token_times=delta.new_token_times[i:i + 1],
                    new_logprobs=None if delta.new_logprobs is None else delta.new_logprobs[i:i + 1],
                    prompt_logprobs=delta.prompt_logprobs if i == 0 else None,
                    finish_reason=delta.finish_reason if i == last else None,
                    stop_reason=delta.stop_reason if i == last else None,
                    finished=delta.finished if i == last else None)
            for i, token in enumerate(delta.new_token_ids)]


@dataclass
class RequestState(_RequestState):
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    queue: Any = None  # where its outputs go (the server's stream)
    sent_chars: int = 0  # of the text, already in an output (DELTA)
    sent_tokens: int = 0
    pooled: list[float] | None = None
    output_type: ClassVar[type[RequestOutput]] = RequestOutput  # with ``pooled``

    def update(self, delta: OutputDelta) -> bool:
        pooled = getattr(delta, "pooled", None)
        if pooled is not None:
            self.pooled = pooled
        params = self.text.params
        if len(delta.new_token_ids) > 1 and params.stop and params.detokenize:
            return any(super(RequestState, self).update(part) for part in one_token_deltas(delta))  # any(): the rest
        return super().update(delta)  # are dropped

    def text_delta(self, finished: bool) -> tuple[str, int, int] | None:
        """``(new text, first new token index, end token index)`` since the last delta; None: nothing new to
        show yet. The text never moves backwards (the final, stop-trimmed text can be shorter than held)."""
        text = self.text.visible(finished)
        delta = text[self.sent_chars:]
        if not delta and not finished:
            return None
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        self.sent_chars = max(self.sent_chars, len(text))
        return delta, start, self.sent_tokens

    def make_output(self) -> RequestOutput | None:
        if self.kind is not RequestOutputKind.DELTA:
            return super().make_output()
        delta = self.text_delta(self.finished)
        return None if delta is None else self.output(*delta)

    def output(self, text: str, start: int, end: int) -> RequestOutput:
        output = super().output(text, start, end)
        output.pooled = self.pooled
        return output


@dataclass
class ProcessedOutputs(OutputProcessorOutput):
    deliveries: list[tuple[Any, RequestOutput]] = field(default_factory=list)  # (its queue, the output)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # their output could not be made
    finished: list[tuple[RequestOutput, SamplingParams]] = field(default_factory=list)  # whole, for stat loggers


class OutputProcessor(_OutputProcessor):
    def __init__(self, tokenizer: Tokenizer, decode_logprobs: bool = False, contain_failures: bool = False):
        super().__init__(tokenizer)
        self.decode_logprobs = decode_logprobs  # fill ``Logprob.decoded_token``
        self.contain_failures = contain_failures  # a request whose output fails fails alone; else it raises
        self.held: dict[str, list] = {}  # by parent id: FINAL_ONLY children's whole outputs, until all finish

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, *, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    parent: ParentRequest | None = None, index: int = 0, queue: Any = None,
                    received: float | None = None, final_only: bool = False) -> None:
        """Track an engine request (a child ``index`` of ``parent``, when ``n > 1``); ``received``: when the
        server got it (``time.monotonic``), for its timeline."""
        kind = RequestOutputKind.FINAL_ONLY if final_only else kind
        self._track(RequestState(
            request_id, prompt, prompt_token_ids, OutputText(self.tokenizer, params),
            RequestTimeline(arrival=arrival_time, received=received), kind is RequestOutputKind.FINAL_ONLY,
            parent, index, request_id if parent is None else parent.request_id,
            logprobs=[] if params.logprobs is not None else None, kind=kind, queue=queue))

    def queues_of(self, request_ids: list[str]) -> list[Any]:
        """The distinct queues of these requests (a caller's id, or any one of its engine ids)."""
        queues: list[Any] = []
        for request_id in request_ids:
            state = self.request_states.get(request_id)
            for engine_id in self.engine_ids.get(request_id if state is None else state.caller_id, ()):
                queue = self.request_states[engine_id].queue
                if not any(queue is q for q in queues):
                    queues.append(queue)
        return queues

    def _result(self) -> ProcessedOutputs:
        return ProcessedOutputs()

    def _process(self, state: RequestState, delta: OutputDelta, result: ProcessedOutputs) -> None:
        try:
            if state.update(delta):
                result.reqs_to_abort.append(state.request_id)
            output = state.make_output()
            if output is not None and self.decode_logprobs:
                self._decode_logprob_tokens(output)
        except BaseException as exc:  # a Rust panic while detokenizing, say: fail this request only
            if not self.contain_failures or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            result.failed.append((delta.request_id, exc))
            return
        if state.finished:
            self._finished(state)
            whole = output if state.kind is RequestOutputKind.CUMULATIVE else \
                state.output(state.text.visible(True), 0, len(state.token_ids))
            # A FINAL_ONLY child reaches its caller only with its siblings: it is reported then.
            held = state.parent is not None and state.kind is RequestOutputKind.FINAL_ONLY
            (self.held.setdefault(state.caller_id, []) if held else result.finished).append((whole, state.text.params))
        if state.parent is not None and output is not None:
            output = self._merge(state, output)
            if output is not None and state.kind is RequestOutputKind.FINAL_ONLY:
                result.finished += self.held.pop(state.caller_id, [])
        if output is not None:
            result.outputs.append(output)
            result.deliveries.append((state.queue, output))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        for request_id in request_ids:
            state = self.request_states.get(request_id)
            self.held.pop(request_id if state is None else state.caller_id, None)
        return super().abort_requests(request_ids)

    def _merge(self, state: RequestState, output: RequestOutput) -> RequestOutput | None:
        """A child's output as its parent's: every child's latest (CUMULATIVE), this child's new part (DELTA),
        or, once all finished, every child's whole output (FINAL_ONLY)."""
        merged = state.parent.merge(state.index, output)
        if state.kind is RequestOutputKind.DELTA:
            return RequestOutput(merged.request_id, output.prompt, output.prompt_token_ids, output.outputs,
                                 finished=merged.finished, timeline=output.timeline,  # the child's own
                                 num_cached_tokens=merged.num_cached_tokens, prompt_logprobs=merged.prompt_logprobs)
        return merged if merged.finished or state.kind is RequestOutputKind.CUMULATIVE else None

    def _decode_logprob_tokens(self, output: RequestOutput) -> None:
        for entry in [*(output.outputs[0].logprobs or ()), *(output.prompt_logprobs or ())]:
            for token_id, logprob in (entry or {}).items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
