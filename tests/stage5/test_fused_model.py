"""stage5's rearranged model: fused q/k/v and gate/up GEMMs and a once-per-step RoPE table give
the plain model's logits (float32, bit for bit) on every supported family."""

from __future__ import annotations

import pytest
import torch

from shared.attention import causal_attention
from shared.weights import load_model
from stage5_server.model import FusedAttention, FusedMLP, StepRotaryEmbedding, fuse_projections


class OneSequence:
    """Causal attention over the batch itself: enough to run a forward without a KV cache."""

    def forward(self, layer_idx, query, key, value, attn_metadata, scale):
        return causal_attention(query, key, value, scale)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
def test_fused_model_gives_the_plain_models_logits(family, checkpoints):
    model, _ = load_model(checkpoints[family])
    model.set_attention_backend(OneSequence())
    ids = torch.randint(0, 500, (37,), generator=torch.Generator().manual_seed(1))
    plain = model.compute_logits(model(ids, torch.arange(37), None))
    fuse_projections(model)
    model.set_attention_backend(OneSequence())
    assert all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
               for layer in model.layers)
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name, _ in model.named_parameters())
    fused = model.compute_logits(model(ids, torch.arange(37), None))
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)


def test_step_rope_recomputes_for_a_new_step_and_reuses_within_one():
    from shared.model import RotaryEmbedding

    plain = RotaryEmbedding(16, 10000.0, None)
    rope = StepRotaryEmbedding(plain)
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    for start in (0, 7):  # two steps, each with its own positions tensor
        positions = torch.arange(start, start + 5)
        for _layer in range(2):
            for got, want in zip(rope(positions, q, k), plain(positions, q, k)):
                torch.testing.assert_close(got, want, atol=0, rtol=0)
