"""Stage 1: a naive engine on one contiguous KV slab with static batching.

Every request reserves ``max_model_len`` contiguous KV slots when it is admitted, and a
batch runs until its slowest member finishes. This is how serving worked before
PagedAttention (FasterTransformer, the first Hugging Face text-generation servers, Orca's
reservation-based memory): correct, simple, and wasteful, because a short answer leaves
most of its reservation empty (internal fragmentation) and differently sized holes
cannot host a new reservation (external fragmentation).

Nothing before it to change; vLLM has no counterpart file: it was designed to replace this.
"""

from shared import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams
from stage1_naive.attention import ContiguousAttentionBackend, ContiguousAttentionMetadata
from stage1_naive.engine import NaiveEngineCore
from stage1_naive.kv_cache import ContiguousKVCache

# ``LLM`` (``llm.py``) loads on first use (``__getattr__`` below): importing the stage loads its engine alone. It is in
# no ``__all__``, so the next stage's ``import *`` takes the rest of the surface and gives its own ``LLM``.
__all__ = [
    "ContiguousKVCache", "ContiguousAttentionBackend", "ContiguousAttentionMetadata", "NaiveEngineCore",
    "SamplingParams", "Request", "RequestStatus", "RequestOutput", "CompletionOutput",
]


def __getattr__(name: str):
    if name == "LLM":  # the offline front end over this stage's engine (``llm.py``), loaded on first use
        from stage1_naive.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
