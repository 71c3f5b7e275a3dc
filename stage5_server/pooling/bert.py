"""A BERT encoder: every token attends to every other (bidirectional, no causal mask), positions are
learned absolute embeddings plus token-type embeddings, and post-attention LayerNorms. Nothing is cached
between steps: each request's whole input runs in one forward, so the model needs no KV cache.

Parameter names match a Hugging Face ``BertModel`` checkpoint's, so the shared loader fills them
(``shared.weights.load_weights``); the checked reference is transformers' ``BertModel`` itself.

vLLM: ``vllm/model_executor/models/bert.py`` (``BertEmbedding``, ``BertEncoder``, ``BertModel``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import read_config_json
from shared.weights import load_weights
from stage5_server.config.model import BERT_ARCHITECTURE, BertConfig, read_bert_config

logger = logging.getLogger(__name__)
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig, eps: float):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden + self.position_embeddings(positions)[None])


class Packing:
    """Where a batch's real tokens sit in its right-padded ``[batch, seq]`` layout. The linear layers,
    the LayerNorms and the MLP run on the real tokens only (``[tokens, hidden]``: no work on padding);
    attention, which needs each sequence's tokens together, scatters them back into the padded layout
    with a mask that hides the padding."""

    def __init__(self, lengths: torch.Tensor, seq: int):
        self.batch, self.seq = lengths.shape[0], seq
        keep = torch.arange(seq, device=lengths.device)[None, :] < lengths[:, None]
        self.index = keep.flatten().nonzero().squeeze(1)
        self.mask = keep[:, None, None, :] if bool((lengths < seq).any()) else None

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, d]`` -> ``[batch, seq, d]``, zeros at the padding."""
        padded = x.new_zeros(self.batch * self.seq, x.shape[-1])
        padded[self.index] = x
        return padded.view(self.batch, self.seq, -1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, d]`` -> ``[tokens, d]``."""
        return x.reshape(self.batch * self.seq, -1)[self.index]


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, packing: Packing) -> torch.Tensor:
        def heads(x: torch.Tensor) -> torch.Tensor:
            return packing.pad(x).view(packing.batch, packing.seq, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(hidden)), heads(self.key(hidden)),
                                             heads(self.value(hidden)), attn_mask=packing.mask)  # no causal mask
        return packing.pack(out.transpose(1, 2))


class BertSelfOutput(nn.Module):
    """The projection after a sub-block, then the residual add and a LayerNorm (post-norm)."""

    def __init__(self, in_size: int, out_size: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_size, out_size)
        self.LayerNorm = nn.LayerNorm(out_size, eps=eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, eps: float):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config.hidden_size, config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, packing: Packing) -> torch.Tensor:
        return self.output(self.self(hidden, packing), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"model: hidden_act {config.hidden_act!r} is not supported; "
                             f"supported: {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig, eps: float):
        super().__init__()
        self.attention = BertAttention(config, eps)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, packing: Packing) -> torch.Tensor:
        hidden = self.attention(hidden, packing)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, eps: float):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, eps) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """BERT's own [CLS] head (dense + tanh); held so its checkpoint tensors have a place, unused by
    sentence-transformers' pooling."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class BertModel(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        eps = config.layer_norm_eps
        self.embeddings = BertEmbeddings(config, eps)
        self.encoder = BertEncoder(config, eps)
        self.pooler = BertPooler(config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [batch, seq]`` right-padded, ``lengths [batch]`` -> final hidden ``[batch, seq, hidden]``."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        packing = Packing(lengths, input_ids.shape[1])
        hidden = packing.pack(self.embeddings(input_ids, token_type_ids))
        for layer in self.encoder.layer:
            hidden = layer(hidden, packing)
        return packing.pad(hidden)


def load_bert(path: str | Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[BertModel, BertConfig]:
    """A ``BertModel`` checkpoint through the shared weight loader."""
    raw = read_config_json(path)
    if BERT_ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(f"model: {path!s} is not a BERT checkpoint ({raw.get('architectures')})")
    config, _ = read_bert_config(raw, path)
    with torch.device("meta"):
        model = BertModel(config)
    load_weights(model, config, Path(path), dtype, device)
    logger.info("loaded bert (%s, %d layers) from %s", dtype, config.num_hidden_layers, path)
    return model.eval(), config
