"""From engine requests to user-facing outputs: detokenize, apply stop strings.

Stop strings are a property of text, not tokens, so they are found here, after
detokenization, and the engine is told to finish the request (as vLLM's
``vllm/v1/engine/output_processor.py`` does). The text is cut before the stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.outputs import CompletionOutput, RequestOutput
from shared.request import Request, RequestStatus
from shared.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    num_seen: int = 0  # output tokens already detokenized
    stopped_by_string: str | None = None
    delta_text: str = ""  # text added by the latest update (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request, prompt: str | None) -> None:
        self.states[request.request_id] = RequestState(request, prompt, IncrementalDetokenizer(self.tokenizer))

    def update(self, request: Request) -> bool:
        """Detokenize new tokens; return True when a stop string just ended the request."""
        state = self.states[request.request_id]
        new_ids = request.output_token_ids[state.num_seen:]
        state.num_seen = request.num_output_tokens
        state.delta_token_ids = new_ids
        if state.stopped_by_string is not None:
            state.delta_text = ""
            return False
        before = len(state.detokenizer.text)
        state.detokenizer.add_tokens(new_ids)
        if request.is_finished:
            state.detokenizer.text = self.tokenizer.decode(request.output_token_ids)  # flush held bytes
        text = state.detokenizer.text
        stops = request.sampling_params.stop
        hit = _find_stop(text, stops, search_from=max(0, before - max(map(len, stops), default=0)))
        if hit is not None:
            index, stop = hit
            state.detokenizer.text = text[:index]
            state.stopped_by_string = stop
            request.stop_reason = stop
        state.delta_text = state.detokenizer.text[before:]
        return hit is not None and not request.is_finished

    def make_output(self, request_id: str) -> RequestOutput:
        state = self.states[request_id]
        req = state.request
        status = req.status
        if state.stopped_by_string is not None:
            status = RequestStatus.FINISHED_STOPPED
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.text,
            token_ids=list(req.output_token_ids),
            finish_reason=status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.sampling_params.logprobs is not None else None,
        )
        return RequestOutput(request_id, state.prompt, list(req.prompt_token_ids), [completion],
                             finished=status.is_finished, timeline=req.timeline,
                             num_cached_tokens=req.num_cached_tokens)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def _find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        i = text.find(stop, search_from)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
