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

A child of a parallel-sampling request (``n > 1``) is merged into its parent's output
(``shared/parallel_sampling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.outputs import CompletionOutput, RequestOutput
from shared.parallel_sampling import ParentRequest
from shared.request import Request, RequestStatus
from shared.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    parent: ParentRequest | None = None
    index: int = 0  # the child's index within its parent
    num_seen: int = 0  # output tokens already detokenized
    stopped_by_string: str | None = None
    no_stop_before: int = 0  # text made by the first min_tokens tokens holds no stop string


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by engine request id
        self.parents: dict[str, ParentRequest] = {}  # by the id the caller knows

    def add_request(self, request: Request, prompt: str | None, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        self.states[request.request_id] = RequestState(request, prompt, IncrementalDetokenizer(self.tokenizer),
                                                       parent, index)
        if parent is not None:
            self.parents[parent.request_id] = parent

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents

    def engine_request_ids(self, request_id: str) -> list[str]:
        """The engine requests behind ``request_id``: a parent's live children, else itself."""
        parent = self.parents.get(request_id)
        if parent is None:
            return [request_id]
        return [child for child in parent.child_ids if child in self.states]

    def update(self, request: Request) -> bool:
        """Detokenize new tokens; return True when a stop string just ended the request."""
        state = self.states[request.request_id]
        params = request.sampling_params
        new_ids = request.output_token_ids[state.num_seen:]
        crossed_min_tokens = state.num_seen <= params.min_tokens < request.num_output_tokens
        state.num_seen = request.num_output_tokens
        if state.stopped_by_string is not None or not params.detokenize:
            return False
        if crossed_min_tokens and params.min_tokens:
            state.no_stop_before = len(self.tokenizer.decode(request.output_token_ids[:params.min_tokens]))
        shown_ids = request.output_token_ids
        if _ended_by_stop_token(request) and not params.include_stop_str_in_output:
            new_ids, shown_ids = new_ids[:-1], shown_ids[:-1]
        before = len(state.detokenizer.text)
        if request.is_finished:  # the whole text at once: nothing comes after it
            state.detokenizer.text = self.tokenizer.decode(shown_ids)
        else:
            state.detokenizer.add_tokens(new_ids)
        if not params.stop or request.num_output_tokens <= params.min_tokens:
            return False
        text = state.detokenizer.text
        search_from = max(before, state.no_stop_before) - max(map(len, params.stop))
        hit = _find_stop(text, params.stop, max(0, search_from))
        if hit is None:
            return False
        index, stop = hit
        state.detokenizer.text = text[:index + len(stop)] if params.include_stop_str_in_output else text[:index]
        state.stopped_by_string = stop
        request.stop_reason = stop
        return not request.is_finished

    def make_output(self, request_id: str) -> RequestOutput:
        """The output for the caller: the request's own, or its parent's with every child so far.

        A finished request's state is dropped here; its parent's once all children finished.
        """
        state = self.states[request_id]
        req = state.request
        params = req.sampling_params
        status = RequestStatus.FINISHED_STOPPED if state.stopped_by_string is not None else req.status
        text = state.detokenizer.text
        hold_back = max(map(len, params.stop), default=1) - 1
        if not status.is_finished and hold_back and not params.include_stop_str_in_output:
            text = text[:max(0, len(text) - hold_back)]
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=list(req.output_token_ids),
            finish_reason=status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if params.logprobs is not None else None,
        )
        output = RequestOutput(request_id, state.prompt, list(req.prompt_token_ids), [completion],
                               finished=status.is_finished, timeline=req.timeline,
                               num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions,
                               prompt_logprobs=list(req.prompt_logprobs) if params.prompt_logprobs is not None
                               else None)
        if status.is_finished:
            del self.states[request_id]
        if state.parent is None:
            return output
        merged = state.parent.merge(state.index, output)
        if merged.finished:
            self.parents.pop(state.parent.request_id, None)
        return merged

    def remove(self, request_id: str) -> None:
        """Forget a request, or a parent and all its children."""
        for engine_id in self.engine_request_ids(request_id):
            self.states.pop(engine_id, None)
        self.parents.pop(request_id, None)


def _ended_by_stop_token(request: Request) -> bool:
    """EOS or one of ``stop_token_ids`` finished it (``check_stop``), not a length cap or a stop string."""
    return request.status == RequestStatus.FINISHED_STOPPED and not isinstance(request.stop_reason, str)


def _find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        i = text.find(stop, search_from)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
