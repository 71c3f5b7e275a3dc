"""What every stage shares: the model, weights, tokenizer, sampling, request and output types, metrics.
Imports no stage.

Importing ``shared`` loads what an engine needs; the offline front end (``BaseLLM``, ``llm_base.py``) and
the tokenizer load on first use. The course's material (tiny checkpoints, workloads, the chat tasks) is
the ``course`` package's, which no stage imports.
"""

import importlib

from shared.config import ModelConfig
from shared.metrics import RequestTimeline, goodput, percentile, summarize
from shared.named_models import default_model, resolve_model, tiny_chat_model
from shared.outputs import CompletionOutput, Logprob, RequestOutput
from shared.request import Request, RequestStatus, check_stop
from shared.sampling_params import SamplingParams

_LAZY = {"BaseLLM": "shared.llm_base", "kv_bytes_per_token": "shared.llm_base",
         "IncrementalDetokenizer": "shared.tokenizer", "Tokenizer": "shared.tokenizer"}

__all__ = [
    "BaseLLM", "CompletionOutput", "IncrementalDetokenizer", "Logprob", "ModelConfig", "Request",
    "RequestOutput", "RequestStatus", "RequestTimeline", "SamplingParams", "Tokenizer", "check_stop",
    "default_model", "goodput", "kv_bytes_per_token", "percentile", "resolve_model", "summarize", "tiny_chat_model",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
