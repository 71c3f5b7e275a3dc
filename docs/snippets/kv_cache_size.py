"""How big the KV cache is, computed from a model's config: SmolLM2-135M-Instruct's shapes.

Every number below comes from the config through the same formula the engines use to size
their caches (``shared.kv_bytes_per_token``); nothing is typed in by hand.

Run: .venv/bin/python docs/snippets/kv_cache_size.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from shared import kv_bytes_per_token  # noqa: E402
from shared.config import ModelConfig  # noqa: E402

# SmolLM2-135M-Instruct's config.json (a Llama): the shapes of the course's default model.
MODEL = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
    qk_norm=False, eos_token_ids=[2],
)
NAME = "SmolLM2-135M-Instruct"
BF16, FP32 = torch.bfloat16, torch.float32
MB, GIB = 1e6, 2**30


def num_parameters(c: ModelConfig) -> int:
    """Embedding, per layer (attention projections, the gated MLP, two norms), final norm, head."""
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = c.hidden_size * q_width + 2 * c.hidden_size * kv_width + q_width * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    per_layer = attention + mlp + 2 * c.hidden_size
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return c.vocab_size * c.hidden_size + c.num_hidden_layers * per_layer + c.hidden_size + head


params = num_parameters(MODEL)
per_token = kv_bytes_per_token(MODEL, BF16)
numbers = 2 * MODEL.num_hidden_layers * MODEL.num_key_value_heads * MODEL.head_dim
print(f"{NAME}: {MODEL.num_hidden_layers} layers, {MODEL.num_attention_heads} query heads, "
      f"{MODEL.num_key_value_heads} KV heads, head_dim {MODEL.head_dim}")
print(f"parameters: {params:,} ({params * 2 / MB:.1f} MB in bf16)")
print()
print(f"K and V of one token, every layer: 2 x {MODEL.num_hidden_layers} x {MODEL.num_key_value_heads} "
      f"x {MODEL.head_dim} = {numbers:,} numbers")
print(f"  bf16: {per_token:,} bytes    fp32: {kv_bytes_per_token(MODEL, FP32):,} bytes")
print("one sequence's KV, bf16:")
for tokens in (9, 512, 2048, MODEL.max_position_embeddings):
    note = "  (R1's prompt)" if tokens == 9 else ("  (the longest it can be)" if tokens == 8192 else "")
    print(f"  {tokens:>6,} tokens: {tokens * per_token / MB:8.2f} MB{note}")
mha = ModelConfig(**{**vars(MODEL), "num_key_value_heads": MODEL.num_attention_heads})
print(f"without GQA (one KV head per query head): {kv_bytes_per_token(mha, BF16):,} bytes a token, "
      f"{MODEL.num_attention_heads // MODEL.num_key_value_heads}x as much")
budget = 4 * GIB
fit = budget // per_token
print(f"4 GiB of KV, bf16: {fit:,} tokens = {fit // 8192} sequences of 8,192 or {fit // 2048} of 2,048")
print()
flops = 2 * params  # one multiply-add per weight per token
weights = 2 * params  # bf16 bytes read per forward pass
print(f"one forward pass reads every weight once: {weights / MB:.0f} MB in bf16")
for label, tokens in (("decode, 1 new token:", 1), ("prefill, 2,048 tokens:", 2048), ("decode at batch 64:", 64)):
    print(f"  {label:<24} {tokens * flops / 1e9:7.2f} GFLOP -> {tokens * flops / weights:6,.0f} FLOP per weight byte")
