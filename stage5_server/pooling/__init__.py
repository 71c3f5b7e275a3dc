"""Pooling: a runner that turns a prompt into one vector instead of generating tokens.

The same scheduler, token budget and (for a decoder) chunked prefill run a pooling request; it
produces no token, finishes the step its prompt is fully computed, and its KV blocks are freed at
once. ``runner="pooling"`` (or a checkpoint whose architecture is an encoder, such as BERT) builds
this runner; ``convert="embed"`` lets a decoder pool too (its last token).

vLLM: ``vllm/model_executor/layers/pooler.py``, ``vllm/model_executor/models/bert.py`` and the
``--runner`` / ``--convert`` choice in ``vllm/config/model.py``.
"""

from stage5_server.config.pooler import PoolerConfig, resolve_runner
from stage5_server.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringRequestOutput

__all__ = ["EmbeddingOutput", "EmbeddingRequestOutput", "PoolerConfig", "ScoringRequestOutput", "resolve_runner"]
