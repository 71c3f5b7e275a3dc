"""The int8 x int8 operator (``cpu_kernels/int8_linear.py``) against its arithmetic written in torch,
and the int8 linear method's choice between it and torch's kernel."""

from __future__ import annotations

import pytest
import torch

from stage5_server.cpu_kernels.int8_linear import cpu_int8_linear, int8_dot_problem, reference_int8_linear
from stage5_server.model import Linear
from stage5_server.quantization.weight_only import Int8LinearMethod, quantize_int8

needs_operator = pytest.mark.skipif(int8_dot_problem() is not None, reason=f"not the fast path: {int8_dot_problem()}")


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)


@needs_operator
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operator_computes_its_own_quantized_arithmetic(rows, dtype):
    weight, scale = _weight(200, 192)  # 3 groups of 64; output rows not a multiple of the 64 per thread
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, :64] = 0  # an all-zero group: scale 0, no division by it
    out = cpu_int8_linear(x, weight, scale)
    expected = reference_int8_linear(x, weight, scale)
    assert out.dtype == dtype and out.shape == (rows, 200)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # float32 sums; bfloat16's last bit
    assert torch.allclose(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    exact = x.double() @ (weight.double() * scale.double()[:, None]).T  # int8 activations cost < 1%
    assert (out.double() - exact).abs().max() < 0.01 * exact.abs().max()


@needs_operator
def test_the_operator_refuses_shapes_it_cannot_take():
    weight, scale = _weight(16, 96)
    with pytest.raises(RuntimeError, match="not a multiple of 64"):
        cpu_int8_linear(torch.randn(1, 96), weight, scale)
    weight, scale = _weight(16, 128)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_int8_linear(torch.randn(1, 64), weight, scale)
    with pytest.raises(RuntimeError, match="scale float32"):
        cpu_int8_linear(torch.randn(1, 128), weight, scale.bfloat16())


def _layer(k: int, int8_activations: bool | None) -> Linear:
    layer = Linear(k, 32, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    layer.method = Int8LinearMethod(int8_activations=int8_activations)
    layer.method.process_weights_after_loading(layer)
    return layer


@needs_operator
def test_the_int8_method_takes_the_operator_where_it_is_fast_and_says_so():
    layer = _layer(128, None)
    x = torch.randn(3, 128).bfloat16()
    assert layer.method.describe(layer) == "int8 with int8 activations"
    assert layer.int8_scale.dtype == torch.float32
    assert torch.equal(layer(x), cpu_int8_linear(x, layer.int8_weight, layer.int8_scale))
    odd = _layer(96, None)  # an input size the operator's groups do not divide: torch's kernel
    assert odd.method.describe(odd) == "int8"


def test_the_int8_method_without_int8_activations_runs_torchs_kernel():
    layer = _layer(128, False)
    x = torch.randn(3, 128).bfloat16()
    assert layer.method.describe(layer) == "int8" and layer.int8_scale.dtype == torch.bfloat16
    assert torch.equal(layer(x), torch.ops.aten._weight_int8pack_mm(x, layer.int8_weight, layer.int8_scale))
