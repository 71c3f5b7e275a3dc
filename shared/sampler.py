"""Turn logits into one token per request, in vLLM's order.

``sample`` takes the logits of each request's last position and, as vLLM's
``vllm/v1/sample/sampler.py`` does:

1. takes logprobs, when a request asks for them, from the raw logits, before anything below;
2. applies what can change even a greedy choice: bad words (``ops/bad_words.py``),
   ``min_tokens`` (EOS and stop tokens masked until the output is long enough) and
   ``logit_bias`` (``logits_processor/builtin.py``), then the repetition, frequency and presence
   penalties (``ops/penalties.py`` over ``vllm/model_executor/layers/utils.py``);
3. gives greedy rows the argmax;
4. divides sampled rows by their temperature, applies min-p, top-k and top-p
   (``ops/topk_topp_sampler.py``), and draws.

The draw is vLLM's: ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn per token picks token i
with probability ``probs[i]``. A seeded request draws its ``q`` from its own
``torch.Generator``, so it samples the same tokens whatever else shares its batch; the other
rows share the runner's generator. Every step works on all rows at once; a batch of plain
greedy rows (no logprobs, nothing from step 2) is a single argmax.

``gather_logprobs`` is also how prefill scores prompt tokens (``prompt_logprobs``).
"""

from __future__ import annotations

import torch

from shared.outputs import Logprob
from shared.request import Request


def sample(logits: torch.Tensor, requests: list[Request], generator: torch.Generator) -> list[int]:
    """``logits [len(requests), vocab]`` -> one token id per request.

    Appends logprobs to ``request.logprobs`` for requests that asked for them.
    """
    if all(_is_plain_greedy(r) for r in requests):
        # max's indices are argmax's (the first of equal maxima), in a third of its time on a CPU
        return logits.max(dim=-1).indices.tolist()
    logits = logits.to("cpu", torch.float32)  # the generators are CPU generators
    num_logprobs = [r.sampling_params.logprobs for r in requests]
    logprob_rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    raw_logprobs = logits[logprob_rows].log_softmax(dim=-1) if logprob_rows else None

    logits = apply_logits_processors(logits, requests)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if random_rows:
        tokens[random_rows] = sample_random(logits[random_rows], [requests[i] for i in random_rows], generator)

    if raw_logprobs is not None:
        entries = gather_logprobs(raw_logprobs, tokens[logprob_rows], [num_logprobs[i] for i in logprob_rows])
        for row, entry in zip(logprob_rows, entries):
            requests[row].logprobs.append(entry)
    return tokens.tolist()


def _is_plain_greedy(request: Request) -> bool:
    params = request.sampling_params
    return (params.greedy and params.logprobs is None and not params.logit_bias and not params.has_penalties
            and not request.bad_words_token_ids and request.num_output_tokens >= params.min_tokens)


# ---- step 2: what can change the argmax ---------------------------------------------------------
def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Bad words and ``min_tokens`` (to -inf), ``logit_bias``, then penalties; a new tensor if any apply."""
    masked: list[tuple[int, int]] = []  # (row, token) pairs set to -inf
    biased: list[tuple[int, int, float]] = []
    penalized: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        masked += [(row, token) for token in banned_by_bad_words(request)]
        if request.num_output_tokens < params.min_tokens:
            masked += [(row, token) for token in request.stop_token_ids_for_min_tokens]
        if params.logit_bias:
            biased += [(row, token, bias) for token, bias in params.logit_bias.items()]
        if params.has_penalties:
            penalized.append(row)
    if not (masked or biased or penalized):
        return logits
    logits = logits.clone()
    if masked:
        rows, tokens = zip(*masked)
        logits[list(rows), list(tokens)] = float("-inf")
    if biased:
        rows, tokens, biases = zip(*biased)
        logits[list(rows), list(tokens)] += torch.tensor(biases, dtype=logits.dtype)
    if penalized:
        logits[penalized] = apply_penalties(logits[penalized], [requests[i] for i in penalized])
    return logits


def banned_by_bad_words(request: Request) -> list[int]:
    """The last token of every bad word whose other tokens the output has just generated.

    As in vLLM, only output tokens count: a bad word cannot start in the prompt.
    """
    output = request.output_token_ids
    banned = []
    for word in request.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """vLLM's penalties (``apply_penalties`` in ``vllm/model_executor/layers/utils.py``):

    - repetition (transformers' ``RepetitionPenaltyLogitsProcessor``): a token seen in the prompt
      or the output has its logit divided by the penalty when positive, multiplied when negative;
    - frequency and presence (OpenAI's definition): ``logit -= frequency * count + presence * (count > 0)``
      over the tokens generated so far.
    """
    vocab = logits.shape[1]
    params = [r.sampling_params for r in requests]
    column = lambda values: torch.tensor(values, dtype=logits.dtype).unsqueeze(1)  # noqa: E731
    output_counts = token_counts([r.output_token_ids for r in requests], vocab)
    in_output = output_counts > 0
    seen = (token_counts([r.prompt_token_ids for r in requests], vocab) > 0) | in_output
    repetition = column([p.repetition_penalty for p in params])
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - column([p.frequency_penalty for p in params]) * output_counts
    return logits - column([p.presence_penalty for p in params]) * in_output


def token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """``[len(token_lists), vocab]``: how often each token occurs in each list."""
    width = max(map(len, token_lists), default=0)
    padded = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.long)
    padded = padded.view(len(token_lists), width)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.long)  # column ``vocab`` takes the padding
    return counts.scatter_add_(1, padded, torch.ones_like(padded))[:, :vocab]


# ---- step 4: the sampled rows --------------------------------------------------------------------
def sample_random(logits: torch.Tensor, requests: list[Request], generator: torch.Generator) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, then one draw per row."""
    return draw(sampling_probs(logits, requests), requests, generator)


def draw(probs: torch.Tensor, requests: list[Request], generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs``: ``argmax(probs / q)``, ``q ~ Exp(1)`` from the request's own generator
    if it is seeded, else from ``generator``. ``probs`` is left as it is."""
    q = torch.empty_like(probs)
    seeded = [(row, r.generator) for row, r in enumerate(requests) if r.generator is not None]
    if len(seeded) < len(requests):
        q.exponential_(generator=generator)
    for row, request_generator in seeded:
        q[row].exponential_(generator=request_generator)
    return probs.div(q).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p applied to sampled rows' logits, as probabilities."""
    params = [r.sampling_params for r in requests]
    vocab = logits.shape[1]
    logits = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params]))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    logits = apply_top_k_top_p(logits, torch.tensor(top_k) if min(top_k) < vocab else None,
                               torch.tensor(top_p) if min(top_p) < 1 else None)
    return logits.softmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's (vLLM's
    ``MinPLogitsProcessor``, transformers' ``MinPLogitsWarper``); a row with 0 keeps every token."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits, then the smallest set of those whose probability
    reaches ``top_p`` (at least one token). ``None`` skips a filter; a row with ``top_k == vocab`` or
    ``top_p == 1`` is left alone by it."""
    if top_p is None:
        return logits if top_k is None else apply_top_k(logits, top_k)
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth_largest = ascending.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth_largest, float("-inf"))
    if top_p is not None:
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_up_to <= 1 - top_p.unsqueeze(1)  # the tokens below still reach top_p without them
        drop[:, -1] = False
        ascending.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k alone needs no sort of the whole vocabulary: the largest ``max(top_k)`` values suffice."""
    unlimited = top_k >= logits.shape[1]
    k = top_k.masked_fill(unlimited, 1)
    kth_largest = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth_largest.masked_fill_(unlimited.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


# ---- logprobs ------------------------------------------------------------------------------------
def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[dict[int, Logprob]]:
    """Per row: the chosen token's logprob and rank, and the row's ``num_top`` best alternatives.

    ``logprobs [rows, vocab]`` (a log-softmax), ``token_ids [rows]``. The chosen token comes first;
    if it is among the best, it appears once.
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen_values, chosen_ids = chosen.squeeze(1).tolist(), token_ids.tolist()
    most = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (None, None)
    top_values, top_ids = (top_values.tolist(), top_ids.tolist()) if most else ([], [])
    entries = []
    for row, k in enumerate(num_top):
        entry = {chosen_ids[row]: Logprob(chosen_values[row], ranks[row])}
        for rank in range(k):
            entry.setdefault(top_ids[row][rank], Logprob(top_values[row][rank], rank + 1))
        entries.append(entry)
    return entries
