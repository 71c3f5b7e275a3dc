"""What every stage shares: the model, weights, tokenizer, sampling, request and output
types, metrics, tiny checkpoints and workloads. Imports no stage.

The tiny checkpoints (``cached_tiny_model``, ``make_tiny_model``) are for tests and benchmarks, not the
engine: they are imported when first asked for.
"""

from shared.config import ModelConfig
from shared.llm_base import BaseLLM, kv_bytes_per_token
from shared.metrics import RequestTimeline, goodput, percentile, summarize
from shared.named_models import default_model, resolve_model, tiny_chat_model
from shared.outputs import CompletionOutput, Logprob, RequestOutput
from shared.request import Request, RequestStatus, check_stop
from shared.sampling_params import SamplingParams
from shared.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "BaseLLM", "CompletionOutput", "IncrementalDetokenizer", "Logprob", "ModelConfig", "Request",
    "RequestOutput", "RequestStatus", "RequestTimeline", "SamplingParams", "Tokenizer", "cached_tiny_model",
    "check_stop", "default_model", "goodput", "kv_bytes_per_token", "make_tiny_model", "percentile", "resolve_model",
    "summarize", "tiny_chat_model",
]


def __getattr__(name: str):
    if name in ("cached_tiny_model", "make_tiny_model"):
        from shared import tiny_model

        return getattr(tiny_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
