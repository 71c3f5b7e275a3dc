"""Which runner a model gets, and how its pooler pools (read from the checkpoint's sentence-transformers files).

``resolve_runner(runner, convert, model_config)``: ``"generate"`` or ``"pooling"``. ``"auto"`` picks pooling
for an encoder architecture (it cannot generate) and generating for a decoder; ``convert="embed"`` turns a
decoder into a pooling model. ``PoolerConfig.from_checkpoint``: the pooling type (``MEAN`` / ``CLS`` /
``LAST``), whether to L2-normalize, and the longest input, as ``modules.json``, ``1_Pooling/config.json``
and ``sentence_bert_config.json`` say; without them vLLM's defaults (CLS for an encoder, LAST for a
decoder, normalized).

vLLM: ``ModelConfig._get_runner`` / ``_get_convert`` in ``vllm/config/model.py``, ``PoolerConfig`` in
``vllm/config/pooler.py``, ``get_pooling_config`` in ``vllm/transformers_utils/config.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import ModelConfig
from stage5_server.config.model import is_encoder

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("MEAN", "CLS", "LAST")
# sentence-transformers' Pooling config flag -> the pooling type it asks for
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
                               "pooling_mode_lasttoken": "LAST"}


def resolve_runner(runner: str, convert: str, model_config: ModelConfig) -> str:
    """``"generate"`` or ``"pooling"`` for this model; a ``ValueError`` names a bad choice."""
    if runner not in RUNNERS:
        raise ValueError(f"runner: unknown {runner!r}; choose one of {list(RUNNERS)}")
    if convert not in CONVERTS:
        raise ValueError(f"convert: unknown {convert!r}; choose one of {list(CONVERTS)}")
    if is_encoder(model_config):
        if runner == "generate":
            raise ValueError(f"runner: a {model_config.family} encoder cannot generate; use runner='pooling'")
        return "pooling"
    if convert == "embed" or runner == "pooling":
        return "pooling"
    return "generate"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # "MEAN" | "CLS" | "LAST"
    normalize: bool  # L2-normalize the pooled vector
    max_seq_length: int | None = None  # sentence-transformers' limit on the input, when it sets one

    @classmethod
    def from_checkpoint(cls, path: str | Path, model_config: ModelConfig) -> PoolerConfig:
        path = Path(path)
        default = "CLS" if is_encoder(model_config) else "LAST"
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls(default, True, None)
        modules = json.loads(modules_file.read_text())
        pooling_type, normalize = default, False
        for module in modules:
            kind = module.get("type", "")
            if kind.endswith("models.Pooling"):
                settings = json.loads((path / module.get("path", "") / "config.json").read_text())
                chosen = [name for flag, name in SENTENCE_TRANSFORMERS_MODES.items() if settings.get(flag)]
                if len(chosen) != 1:
                    raise ValueError(f"model: {path!s} pools in a way this engine lacks: {settings}")
                pooling_type = chosen[0]
            elif kind.endswith("models.Normalize"):
                normalize = True
        st_config = path / "sentence_bert_config.json"
        max_seq_length = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
        return cls(pooling_type, normalize, max_seq_length)


def pooling_args(args: dict[str, Any], model_config: ModelConfig, pooler: PoolerConfig) -> dict[str, Any]:
    """What the pooling runner changes: ``runner`` resolved; sentence-transformers' ``max_seq_length`` as the
    default ``max_model_len``; an encoder runs each prompt whole (no chunked prefill: its attention looks both
    ways) and reuses no cached prefix (a later token changes every earlier token's state), as in vLLM."""
    changed: dict[str, Any] = {"runner": "pooling"}
    if args["max_model_len"] is None and pooler.max_seq_length:
        changed["max_model_len"] = min(pooler.max_seq_length, model_config.max_position_embeddings)
    if is_encoder(model_config) or pooler.pooling_type != "LAST":  # a cached prefix has no hidden states
        changed["enable_prefix_caching"] = False
    if is_encoder(model_config):
        changed["enable_chunked_prefill"] = False
    return changed


def input_type_prompts(path: str | Path) -> dict[str, str]:
    """The prompt prefix of each input type the checkpoint defines: ``task_instructions`` in ``config.json``,
    else sentence-transformers' ``prompts`` (``config_sentence_transformers.json``); empty when it defines none.
    vLLM reads the same two (``CohereServingEmbedding`` in ``vllm/entrypoints/pooling/embed/cohere/serving.py``)."""
    path = Path(path)
    for name, key in (("config.json", "task_instructions"), ("config_sentence_transformers.json", "prompts")):
        file = path / name
        found = json.loads(file.read_text()).get(key) if file.is_file() else None
        if isinstance(found, dict) and found:
            return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}
    return {}
