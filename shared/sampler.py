"""Turn the last position's logits into one token per request.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p, then draw
with the request's own ``torch.Generator`` when it has a seed, so a seeded request gets
the same tokens whatever else shares its batch. Logprobs come from the raw logits.

vLLM: ``vllm/v1/sample/sampler.py``; nano-vllm: ``layers/sampler.py``.
"""

from __future__ import annotations

import torch

from shared.outputs import Logprob
from shared.request import Request


def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator) -> list[int]:
    """``logits [len(requests), vocab]`` (float32) -> one token id per request.

    Appends logprobs to ``request.logprobs`` for requests that asked for them.
    """
    logits = logits.float().cpu()
    tokens = logits.argmax(dim=-1).tolist()
    for row, req in enumerate(requests):
        params = req.sampling_params
        if not params.greedy:
            tokens[row] = _draw(logits[row], params, req.generator or generator)
        if params.logprobs is not None:
            req.logprobs.append(_logprobs(logits[row], tokens[row], params.logprobs))
    return tokens


def _draw(row: torch.Tensor, params, generator: torch.Generator) -> int:
    row = row / params.temperature
    if params.top_k > 0 and params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = row.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        drop = probs.cumsum(-1) - probs > params.top_p
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = row.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _logprobs(row: torch.Tensor, token: int, num_top: int) -> dict[int, Logprob]:
    logprobs = row.log_softmax(-1)
    chosen = float(logprobs[token])
    result = {token: Logprob(chosen, rank=int((logprobs > chosen).sum()) + 1)}
    if num_top:
        top = torch.topk(logprobs, num_top)
        for rank, (value, tok) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            result.setdefault(tok, Logprob(value, rank))
    return result
