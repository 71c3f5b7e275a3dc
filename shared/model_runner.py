"""Pack the scheduled tokens into one flat batch, run the model, sample.

Every stage hands the runner the same thing: a list of ``(request, num_new_tokens)``.
Request ``r`` contributes tokens ``r.num_computed_tokens .. + num_new_tokens`` at those
positions. Only a request whose scheduled tokens reach its last known token gets a
new token sampled; a request in the middle of a chunked prefill does not. A request that
asks for ``prompt_logprobs`` also has every prompt position of its chunk scored against the
prompt token that follows it, so chunked prefill yields them chunk by chunk.
How K/V are addressed is the stage's business: it passes its own attention metadata.
A request with structured output has the tokens its grammar forbids masked out of its logits
row just before sampling (``shared/structured_output.py``).

vLLM: ``vllm/v1/worker/gpu_model_runner.py`` (``_prepare_inputs``, ``execute_model``,
``_get_prompt_logprobs_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shared.model import DecoderModel
from shared.request import Request
from shared.sampler import gather_logprobs, sample
from shared.structured_output import apply_grammar_bitmask

ScheduledBatch = list[tuple[Request, int]]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]: tokens in the cache once this step has run
    sample_rows: list[int]  # which sequences produce a token this step


def prepare_inputs(batch: ScheduledBatch, device: torch.device | str = "cpu") -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    query_start_loc = [0]
    seq_lens = []
    sample_rows = []
    for row, (req, num_new) in enumerate(batch):
        start = req.num_computed_tokens
        end = start + num_new
        assert 0 < num_new and end <= req.num_tokens, (req, num_new)
        input_ids.extend(req.all_token_ids[start:end])
        positions.extend(range(start, end))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        if end == req.num_tokens:
            sample_rows.append(row)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return StepInputs(as_tensor(input_ids), as_tensor(positions), query_start_loc, seq_lens, sample_rows)


class ModelRunner:
    def __init__(self, model: DecoderModel, device: torch.device | str, seed: int = 0):
        self.model = model
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded sampled requests

    def execute(self, batch: ScheduledBatch, inputs: StepInputs, attn_metadata: Any) -> dict[str, int]:
        """Run one forward pass; return ``{request_id: sampled token}`` for sampling rows."""
        hidden = self.model(inputs.input_ids, inputs.positions, attn_metadata)
        score_prompt_tokens(self.model, batch, inputs, hidden)
        if not inputs.sample_rows:
            return {}
        last = torch.tensor([inputs.query_start_loc[r + 1] - 1 for r in inputs.sample_rows], device=hidden.device)
        logits = self.model.compute_logits(hidden[last])
        requests = [batch[r][0] for r in inputs.sample_rows]
        tokens = sample(apply_grammar_bitmask(logits, requests), requests, self.generator)
        return {req.request_id: tok for req, tok in zip(requests, tokens)}


def score_prompt_tokens(model: DecoderModel, batch: ScheduledBatch, inputs: StepInputs, hidden: torch.Tensor) -> None:
    """Append to ``request.prompt_logprobs`` the prompt tokens this step's positions predict.

    Position p of the prompt predicts prompt token p + 1. A position scored before (the request
    was preempted and recomputed) is not scored again.
    """
    rows, targets, num_top, owners = [], [], [], []
    for row, (request, num_new) in enumerate(batch):
        k = request.sampling_params.prompt_logprobs
        if k is None or len(request.prompt_logprobs) == request.num_prompt_tokens:
            continue
        start = request.num_computed_tokens
        first = len(request.prompt_logprobs) - 1  # the first position still to score
        assert start <= first, "prompt positions were skipped (a prefix-cache hit?) before they were scored"
        last = min(start + num_new, request.num_prompt_tokens - 1)
        for position in range(first, last):
            rows.append(inputs.query_start_loc[row] + position - start)
            targets.append(request.prompt_token_ids[position + 1])
            num_top.append(k)
            owners.append(request)
    if not rows:
        return
    logits = model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
    logprobs = logits.to("cpu", torch.float32).log_softmax(dim=-1)
    for request, entry in zip(owners, gather_logprobs(logprobs, torch.tensor(targets), num_top)):
        request.prompt_logprobs.append(entry)
