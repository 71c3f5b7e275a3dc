"""Every projection of stage 5's model, fused or split across ranks, goes through one linear seam:
a ``LinearMethod`` installed after loading computes every product."""

from __future__ import annotations

import torch
from torch import nn

from shared import SamplingParams
from shared.config import ModelConfig
from stage5_server import LLM
from stage5_server.model import UNQUANTIZED, Linear, LinearMethod, use_linear_method
from stage5_server.parallel.sharded_model import build_sharded_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class CountingMethod(LinearMethod):
    """The unquantized product, counting the layers it was installed on and the calls it serves."""

    def __init__(self):
        self.layers, self.calls = 0, 0

    def process_weights_after_loading(self, layer):
        self.layers += 1

    def apply(self, layer, x, bias=None):
        self.calls += 1
        return super().apply(layer, x, bias)


def test_every_projection_of_the_served_model_is_a_linear_behind_the_seam(tiny_llama):
    llm = LLM(str(tiny_llama), **ENGINE)
    model = llm.engine.model_executor.driver_worker.model
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear]
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    per_layer = 4  # qkv, o, gate_up, down
    assert len(layers) == per_layer * model.config.num_hidden_layers + 1  # and the LM head
    assert all(layer.method is UNQUANTIZED for layer in layers)

    method = CountingMethod()
    use_linear_method(model, method)
    expected = LLM(str(tiny_llama), **ENGINE).generate(["hello there"], GREEDY, use_tqdm=False)
    got = llm.generate(["hello there"], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids  # unquantized: the same tokens
    assert method.layers == len(layers)
    assert method.calls >= len(layers) * GREEDY.max_tokens  # every layer, every step


def test_the_tensor_parallel_layers_are_linears_too(tiny_llama):
    model = build_sharded_model(ModelConfig.from_pretrained(tiny_llama), rank=0, world_size=2)
    attn = model.layers[0].self_attn
    assert all(isinstance(m, Linear) for m in (attn.q_proj, attn.o_proj, model.layers[0].mlp.down_proj))
    layer = attn.o_proj
    method = CountingMethod()
    use_linear_method(model, method)
    layer.weight = nn.Parameter(torch.ones(layer.out_features, layer.in_features))
    assert torch.equal(layer(torch.ones(1, layer.in_features)), torch.full((1, layer.out_features),
                                                                            float(layer.in_features)))
    assert method.calls == 1  # the row-parallel layer (one rank here: no sum) computed through the method
