"""The C++ elementwise operators (``cpu_kernels/elementwise.py``) against the torch code they replace, and
the engine that runs them: a bfloat16 model on a CPU, logprob-close to the same engine without them."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from shared import SamplingParams
from shared.closeness import as_token_logprobs, first_divergences
from shared.model import RMSNorm
from stage5_server import LLM
from stage5_server.cpu_kernels import cpu_elementwise_kernels, load_cpu_kernels
from stage5_server.cpu_kernels.elementwise import SWITCH
from stage5_server.model.fused import _rotate_half
from tests.invariants.prompts import PROMPTS

pytestmark = pytest.mark.skipif(load_cpu_kernels() is not None, reason="the C++ CPU operators did not build")
KERNELS = cpu_elementwise_kernels(torch.device("cpu"), torch.bfloat16)
LOW = [torch.bfloat16, torch.float16]


def assert_rounding_apart(got: torch.Tensor, want: torch.Tensor, exact_share: float) -> None:
    """Equal but for a float sum's order: at most one step of the dtype apart, and mostly identical."""
    assert got.shape == want.shape and got.dtype == want.dtype
    step = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    assert ((got.float() - want.float()).abs() <= step * 2).all()
    assert got.numel() == 0 or (got == want).float().mean().item() >= exact_share


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_rms_norm_rounds_as_the_torch_norm(dtype, rows):
    norm = RMSNorm(576, 1e-5).to(dtype)
    torch.manual_seed(rows)
    norm.weight.data = torch.randn(576, dtype=dtype)
    x = torch.randn(rows, 576, dtype=dtype) * 3
    assert_rounding_apart(KERNELS.rms_norm(x, norm.weight, norm.eps), norm(x), exact_share=0.99)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("width", [64, 1000, 1536])  # within one chunk, a partial last chunk, the default model
def test_silu_and_mul_rounds_as_silu_times_up(dtype, width):
    gate_up = torch.randn(33, 2 * width, dtype=dtype) * 4
    gate, up = gate_up.split(width, dim=-1)
    assert_rounding_apart(KERNELS.silu_and_mul(gate_up), F.silu(gate) * up, exact_share=0.99)


@pytest.mark.parametrize("dtype", LOW)
def test_rotate_half_reads_heads_out_of_the_fused_qkv_rows(dtype):
    qkv = torch.randn(19, 15 * 64, dtype=dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(19, 9, 64), k.view(19, 3, 64)  # rows 960 apart, as FusedAttention splits them
    angles = torch.randn(19, 1, 64)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for x in (q, k):
        assert torch.equal(KERNELS.rotate_half(x, cos, sin), _rotate_half(x, cos, sin))


def test_the_operators_refuse_shapes_they_cannot_read():
    with pytest.raises(RuntimeError, match="weight must be"):
        KERNELS.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        KERNELS.silu_and_mul(torch.randn(2, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="cos and sin"):
        x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
        KERNELS.rotate_half(x, torch.randn(2, 1, 8, dtype=torch.bfloat16), torch.randn(2, 1, 8, dtype=torch.bfloat16))


def test_only_a_low_precision_model_on_a_cpu_gets_them_and_the_switch_turns_them_off(monkeypatch):
    assert cpu_elementwise_kernels(torch.device("cpu"), torch.float32) is None  # the reference stays torch's
    assert cpu_elementwise_kernels(torch.device("meta"), torch.bfloat16) is None
    monkeypatch.setenv(SWITCH, "0")
    assert cpu_elementwise_kernels(torch.device("cpu"), torch.bfloat16) is None


def _generate(model, caplog) -> tuple[list, list, bool]:
    """Greedy tokens and top-5 logprobs of a bfloat16 engine, and whether it said it runs the operators."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        llm = LLM(model=str(model), device="cpu", dtype="bfloat16", max_model_len=128, block_size=8,
                  max_num_batched_tokens=32)
    said = "one C++ operator each" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [as_token_logprobs(o.outputs[0].logprobs) for o in outs], said


def test_a_bfloat16_engine_with_the_operators_is_logprob_close_to_one_without(tiny_llama, monkeypatch, caplog):
    ids_with, lps_with, said = _generate(tiny_llama, caplog)
    assert said
    monkeypatch.setenv(SWITCH, "0")
    ids_without, lps_without, said = _generate(tiny_llama, caplog)
    assert not said
    divergences = first_divergences(ids_with, lps_with, ids_without, lps_without)
    assert all(d.close for d in divergences), divergences
    assert len(divergences) < len(PROMPTS)  # near-ties aside, the same tokens


def test_the_benchmark_times_each_operator_beside_its_torch_code():
    from benchmarks.cpu_elementwise import operator_rows

    rows = operator_rows(torch.bfloat16, 4)
    assert [r["op"] for r in rows] == ["RMSNorm", "SiLU(gate) * up", "RoPE (q)"]
    assert all(r["rows"] == 4 and r["torch_us"] > 0 and r["operator_us"] > 0 for r in rows)
