"""What ``LLM.generate`` returns (mirrors vLLM's ``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared.metrics import RequestTimeline


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0  # times the scheduler preempted it (and recomputed its KV later)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing precedes it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, later: RequestOutput) -> RequestOutput:
        """One delta output that says what this one and then ``later`` said (completions matched by index)."""
        completions = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = completions.get(new.index)
            completions[new.index] = new if old is None else replace(
                new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids,
                logprobs=None if old.logprobs is None else old.logprobs + (new.logprobs or []))
        return replace(later, outputs=sorted(completions.values(), key=lambda c: c.index))
