"""How many drafts a request proposes next step: only the ones expected to pay for their positions.

A draft is not free. Verifying it adds a position to the step, and a position costs compute:
next to nothing on a GPU running a small batch (the step is bound by reading the weights),
more on a CPU. Model a step of ``T`` positions as costing ``a + b T``: a fixed part ``a``
(reading the weights, launching the layers) and ``b`` per position. On the two-CPU machine
of ``benchmarks/results/cpu_roofline.json`` (``python -m benchmarks.cpu_roofline``), the default
model's bf16 matrix multiplies take about 1.1 times as long for 16 tokens as for 1, and 1.8
times for 64: ``r = b / a`` is about 0.015 there.

So the policy compares, per request and per step:

- the gain of its ``j``-th draft: it is kept only if the ``j - 1`` before it were, so with a
  per-token acceptance probability ``alpha`` it is worth ``alpha ** j`` tokens;
- its cost: one position, ``b``, against the cost of a token without speculation at batch
  ``B``, ``(a + b B) / B``. Their ratio is ``theta(B) = r B / (1 + r B)`` with ``r = b / a``.

A draft model adds a cost of its own: every draft is one more forward pass of the draft over
the requests that draft. At small batches a pass costs what reading its weights costs, so a
draft token costs ``rho`` plain tokens, with ``rho`` the draft's weights per token over the
target's (``forward_weights``: the projections of every layer and the LM head). The threshold
becomes ``theta(B) + rho``: for a draft cut from SmolLM2's first 6 of 30 layers, ``rho`` is
about 0.37 (the head alone is a fifth of the model), so only drafts likelier than about 0.38 are
worth proposing. An n-gram lookup costs nothing on that scale: ``rho = 0``.

A request proposes the largest ``j <= k`` with ``alpha ** j >= theta(B) + rho``. On that CPU
``theta`` is 0.015 at batch 1, where a request whose drafts are kept a third of the time still
drafts three, and 0.19 at batch 16, where it drafts one and a request that copies drafts ``k``;
at batch 64 (``theta`` 0.49) only near-certain drafts are worth a position. On a GPU ``theta``
stays near 0 and every request drafts ``k`` unless its acceptance collapses, as in vLLM.

``alpha`` is the request's own recent acceptance: accepted drafts over drafts examined (the
accepted ones and the first rejected one; later drafts were never checked), with older steps
weighing less (``DECAY``) and an optimistic prior, so a new request starts by drafting. A request
that stops drafting would never learn that its text turned into a copy, so every
``PROBE_EVERY``-th step it drafts one token anyway. A probe costs what any draft costs, the
threshold (mostly ``rho`` for a draft model), so probes come less often where they cost more:
every ``threshold / PROBE_BUDGET`` steps if that is longer, which keeps them near 2% of the
steps' time (every 20 steps for the 6-layer draft above, every 8 for prompt lookup at batch 1).

None of this can change an output: every draft is verified, and a request's tokens are the
same with any number of drafts. It changes only how many positions a step spends.

vLLM has the batch side of this as ``disable_by_batch_size`` (no speculation past a batch size)
and no per-request rule in V1; ``vllm/v1/spec_decode/metrics.py`` counts the acceptance the rule
here reads. Adaptive draft lengths are in, e.g., "Dynamic speculation lookahead" (Mamou et al.,
2024) and SGLang's speculative ``num_draft_tokens`` tuning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.config import ModelConfig

# b / a: the cost of one more position over the fixed cost of a step (module docstring).
POSITION_COST_RATIO = {"cpu": 0.015, "cuda": 0.002}
DEFAULT_POSITION_COST_RATIO = 0.002
PRIOR_ACCEPTED, PRIOR_EXAMINED = 1.6, 2.0  # a new request starts at alpha = 0.8
DECAY = 0.8  # weight of a verification relative to the next one
PROBE_EVERY = 8
PROBE_BUDGET = 0.02  # the share of a request's steps' time its probes may take


@dataclass
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED
    examined: float = PRIOR_EXAMINED
    steps_without_drafts: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.examined


def forward_weights(config: ModelConfig) -> int:
    """The weights one token is multiplied by in a forward pass: each layer's projections and the LM head."""
    q, kv = config.num_attention_heads * config.head_dim, 2 * config.num_key_value_heads * config.head_dim
    layer = config.hidden_size * (2 * q + kv + 3 * config.intermediate_size)
    return config.num_hidden_layers * layer + config.vocab_size * config.hidden_size


class DraftPolicy:
    def __init__(self, num_speculative_tokens: int, position_cost_ratio: float, draft_cost_ratio: float = 0.0):
        self.k = num_speculative_tokens
        self.r = position_cost_ratio
        self.rho = draft_cost_ratio  # a draft model's pass over a target's (module docstring); 0 for n-gram
        self.requests: dict[str, _Acceptance] = {}

    @classmethod
    def for_device(cls, num_speculative_tokens: int, device_type: str, draft_cost_ratio: float = 0.0) -> DraftPolicy:
        return cls(num_speculative_tokens, POSITION_COST_RATIO.get(device_type, DEFAULT_POSITION_COST_RATIO),
                   draft_cost_ratio)

    def threshold(self, batch_size: int) -> float:
        """``theta(B) + rho``: the acceptance probability a draft must reach to pay at this batch."""
        return self.r * batch_size / (1 + self.r * batch_size) + self.rho

    def num_drafts(self, request_id: str, batch_size: int) -> int:
        """How many drafts ``request_id`` should propose for its next step in a batch of ``batch_size``."""
        state = self.requests.setdefault(request_id, _Acceptance())
        alpha, theta = state.alpha, self.threshold(batch_size)
        j, gain = 0, 1.0
        while j < self.k and gain * alpha >= theta:
            j, gain = j + 1, gain * alpha
        if j == 0:
            state.steps_without_drafts += 1
            if state.steps_without_drafts >= max(PROBE_EVERY, math.ceil(theta / PROBE_BUDGET)):
                return 1
        return j

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification: ``num_accepted`` of the ``num_drafts`` drafts were kept."""
        state = self.requests.setdefault(request_id, _Acceptance())
        examined = num_accepted + (1 if num_accepted < num_drafts else 0)
        state.accepted = DECAY * state.accepted + num_accepted
        state.examined = DECAY * state.examined + examined
        state.steps_without_drafts = 0

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
