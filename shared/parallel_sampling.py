"""Parallel sampling: a request with ``n > 1`` runs as n child requests, merged back into one output.

The front end fans the request out; the engine only ever sees ordinary ``n = 1`` requests.
Child i is named ``f"{i}_{parent_id}"`` and, when the parent is seeded, samples with
``seed + i``: both as vLLM does. The children share one prompt, so with prefix caching
(stage4 on) every child after the first finds the prompt's full blocks in the cache and
prefills only the last, partial block: n samples cost about one prompt's prefill.

Prompt logprobs are the same for every child, so only child 0 computes them. That also keeps
the cache hit for the others, since a request that asks for them cannot read the cache.

vLLM: ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``).
"""

from __future__ import annotations

from dataclasses import replace

from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, sampling_params: SamplingParams):
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.child_ids = [f"{i}_{request_id}" for i in range(sampling_params.n)]
        self.latest: list[CompletionOutput | None] = [None] * sampling_params.n
        self.first_child_output: RequestOutput | None = None  # prompt logprobs, cache hits, timeline

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def child_params(self, index: int) -> SamplingParams:
        seed = self.sampling_params.seed
        return replace(self.sampling_params, n=1, seed=None if seed is None else seed + index,
                       prompt_logprobs=self.sampling_params.prompt_logprobs if index == 0 else None)

    def merge(self, index: int, child_output: RequestOutput) -> RequestOutput:
        """The parent's output now that child ``index`` produced ``child_output``: the latest
        completion of every child heard from so far, in index order; finished once all are."""
        completion = child_output.outputs[0]
        completion.index = index
        self.latest[index] = completion
        if index == 0:
            self.first_child_output = child_output
        completions = [c for c in self.latest if c is not None]
        first = self.first_child_output or child_output
        return RequestOutput(self.request_id, child_output.prompt, child_output.prompt_token_ids, completions,
                             finished=len(completions) == self.n and all(c.finished for c in completions),
                             timeline=first.timeline, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)
