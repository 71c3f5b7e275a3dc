"""Stage 5's faster linear methods (``stage5_server/quantization/``): a GGUF file's Q4 blocks become
int4 groups exactly, every method stays logprob-close to the unquantized model, the
``quantization`` and ``prepack_linear`` arguments are checked once, and a missing kernel falls back."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from shared import SamplingParams
from shared.closeness import as_token_logprobs, first_divergences
from shared.config import ModelConfig
from shared.gguf import convert_gguf, read_raw_tensors
from stage5_server import LLM
from stage5_server.cli import make_parser
from stage5_server.config import QUANTIZATION_CHOICES, EngineConfig
from stage5_server.cpu_kernels.int8_linear import int8_dot_problem
from stage5_server.model import Linear
from stage5_server.quantization import QUANTIZATION_METHODS, PackedLinearMethod, resolve_linear_config, weight_only
from stage5_server.quantization import config as linear_config
from stage5_server.quantization.dispatch import RowDispatchLinearMethod
from stage5_server.quantization.gguf import dequantize_q8_0, int4_groups
from stage5_server.quantization.packed import pack_weight
from stage5_server.quantization.weight_only import Int4LinearMethod, Int8LinearMethod
from tests.shared.gguf_files import write_gguf

ENGINE = dict(device="cpu", max_model_len=96, max_num_seqs=4, block_size=4, seed=0)
# What an int8 layer's start-up line says: with AVX512-VNNI (and the operators built) its activations go int8 too.
INT8 = "int8" if int8_dot_problem() else "int8 with int8 activations"
PROMPTS = ["hello there", "the cat sat on", "one two three", "a b c d e"]
CHECK = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


def greedy_with_logprobs(llm: LLM):
    outs = llm.generate(PROMPTS, CHECK, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [as_token_logprobs(o.outputs[0].logprobs) for o in outs]


def assert_close(reference, got):
    divergences = first_divergences(*reference, *got)
    assert all(d.close for d in divergences), divergences


def served_layers(llm: LLM) -> dict[str, Linear]:
    model = llm.engine.model_executor.driver_worker.model
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


@pytest.fixture(scope="module")
def tiny_ggufs(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("quantized-gguf")
    return {kind: write_gguf(tiny_llama, out / f"tiny-{kind}.gguf", kind) for kind in ("Q4_0", "Q4_1", "Q8_0")}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_to_exactly_the_weights_the_converter_dequantizes(tiny_ggufs, tmp_path, kind):
    convert_gguf(tiny_ggufs[kind], tmp_path)
    dequantized = load_file(tmp_path / "model.safetensors")
    raw = read_raw_tensors(tiny_ggufs[kind])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        type_name, data = raw[name]
        assert type_name == kind
        ours = dequantize_q8_0(data) if kind == "Q8_0" else int4_groups(kind, data).dequantize()
        assert torch.equal(ours, dequantized[name]), name  # q rows unpermuted as the converter does


def test_a_q4_1_block_is_one_int4_group_whose_zero_is_the_minimum_plus_eight_scales():
    weight = torch.randn(16, 64)
    groups = weight_only.Int4Groups.quantize(weight)
    blocks = weight.reshape(16, 2, 32)
    assert torch.allclose(groups.scale, (blocks.amax(-1) - blocks.amin(-1)) / 15)
    assert torch.allclose(groups.zero - 8 * groups.scale, blocks.amin(-1))
    assert (groups.dequantize() - weight).abs().max() <= groups.scale.max() / 2 + 1e-6


@pytest.mark.parametrize("engine_args", [dict(quantization="int8", prepack_linear=False),
                                         dict(quantization="int4", prepack_linear=False),
                                         dict(quantization="int8", prepack_linear=True),
                                         dict(prepack_linear=True), dict(prepack_linear=False)],
                         ids=["int8", "int4", "int8+packed", "packed", "plain"])
def test_each_linear_method_is_close_to_the_float32_model(tiny_llama, engine_args, caplog):
    reference_llm = LLM(str(tiny_llama), dtype="float32", **ENGINE)
    if engine_args.get("quantization") == "int4":  # 4 bits move a random model's near-flat logits:
        for layer in served_layers(reference_llm).values():  # compare with its own dequantized weights
            groups = weight_only.Int4Groups.quantize(layer.weight)
            layer.weight = torch.nn.Parameter(groups.dequantize(), requires_grad=False)
    reference = greedy_with_logprobs(reference_llm)
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        llm = LLM(str(tiny_llama), dtype="bfloat16", **engine_args, **ENGINE)
    float_kind = "plain" if not engine_args["prepack_linear"] else packed_kind()
    quantization = engine_args.get("quantization")
    kind = float_kind if quantization is None else (INT8 if quantization == "int8" else quantization) + (
        f" up to 8 rows, else {float_kind}" if engine_args["prepack_linear"] else "")
    assert {layer.method.describe(layer) for layer in served_layers(llm).values()} == {kind}
    assert any(r.message.startswith(f"linear layers: 9 {kind}: ") for r in caplog.records)
    assert_close(reference, greedy_with_logprobs(llm))


@pytest.mark.parametrize("prepack", [False, True], ids=["blocks", "blocks+packed"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_a_gguf_file_runs_its_own_blocks_close_to_its_dequantized_model(tiny_ggufs, kind, prepack):
    path = str(tiny_ggufs[kind])
    reference = greedy_with_logprobs(LLM(path, dtype="float32", **ENGINE))
    llm = LLM(path, dtype="bfloat16", quantization="gguf", prepack_linear=prepack, **ENGINE)
    want = f"int4 (GGUF {kind} blocks)" if kind != "Q8_0" else f"{INT8} (GGUF Q8_0 requantized per row)"
    want += f" up to 8 rows, else {packed_kind()}" if prepack else ""
    layers = served_layers(llm)
    assert {layer.method.describe(layer) for layer in layers.values()} == {want}
    # the tied LM head holds only its quantized copy (and, for more rows, its packed one), not the embedding's;
    # where oneDNN cannot pack bfloat16 (no AVX-512), the many-rows side keeps the plain weight for F.linear
    plain_kept = prepack and not bf16_packs()
    assert (layers["lm_head"].weight.numel() > 0) == plain_kept
    assert llm.engine.model_executor.driver_worker.model.embed_tokens.weight.numel() > 0
    assert_close(reference, greedy_with_logprobs(llm))


def test_quantization_accepts_its_methods_and_names_the_argument_otherwise(tiny_llama):
    assert QUANTIZATION_CHOICES == (*QUANTIZATION_METHODS, "none")
    assert make_parser().parse_args(["serve", "-q", "gguf"]).quantization == "gguf"
    with pytest.raises(ValueError, match=r"quantization: unknown method 'awq'.*'gguf', 'int8', 'int4', 'none'"):
        EngineConfig.create(str(tiny_llama), device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="quantization: 'gguf' .* not a .gguf file"):
        EngineConfig.create(str(tiny_llama), device="cpu", quantization="gguf")
    with pytest.raises(ValueError, match="prepack_linear: must be a bool"):
        EngineConfig.create(str(tiny_llama), device="cpu", prepack_linear="yes")


def test_a_method_the_model_or_device_cannot_use_is_refused(tiny_llama):
    config = ModelConfig.from_pretrained(tiny_llama)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    odd = replace(config, intermediate_size=200)  # down_proj's 200 inputs: not whole groups of 32
    with pytest.raises(ValueError, match=r"'int4' cannot hold this model's down_proj \(128x200\)"):
        resolve_linear_config("int4", None, None, cpu, bf16, odd, 1)
    assert resolve_linear_config("int8", None, None, cpu, bf16, odd, 1).quantization == "int8"
    with pytest.raises(ValueError, match="quantization: 'int8' runs torch's CPU kernels; .* cuda"):
        resolve_linear_config("int8", None, None, torch.device("cuda"), bf16, config, 1)
    with pytest.raises(ValueError, match="runs on one rank; this engine has 2"):
        resolve_linear_config("int8", None, None, cpu, bf16, config, 2)
    with pytest.raises(ValueError, match="prepack_linear: packs weights for a CPU"):
        resolve_linear_config(None, True, None, torch.device("cuda"), bf16, config, 1)


def test_a_missing_kernel_refuses_an_explicit_method_and_drops_the_measured_default(tiny_ggufs, monkeypatch):
    path = str(tiny_ggufs["Q4_1"])
    monkeypatch.setattr(linear_config, "AUTO_QUANTIZE_GGUF", True)
    assert EngineConfig.create(path, device="cpu", dtype="bfloat16").linear.quantization == "gguf"
    monkeypatch.setitem(weight_only.KERNELS, "int4", ("_no_such_int4_kernel",))  # an older torch
    with pytest.raises(ValueError, match="quantization: 'gguf' needs torch's int4 weight-only CPU kernels"):
        EngineConfig.create(path, device="cpu", quantization="gguf")
    assert EngineConfig.create(path, device="cpu", dtype="bfloat16").linear.quantization is None


def test_measured_defaults_never_apply_in_float32(tiny_ggufs, monkeypatch):
    monkeypatch.setattr(linear_config, "AUTO_QUANTIZE_GGUF", True)
    monkeypatch.setattr(linear_config, "AUTO_PREPACK", True)
    path = str(tiny_ggufs["Q4_1"])
    assert EngineConfig.create(path, device="cpu", dtype="float32").linear == linear_config.LinearConfig(
        None, False, None)
    assert EngineConfig.create(path, device="cpu", dtype="bfloat16").linear == linear_config.LinearConfig(
        "gguf", True, path)
    assert EngineConfig.create(path, device="cpu", dtype="bfloat16", quantization="none").linear == \
        linear_config.LinearConfig(None, True, None)  # "none": the float weights, still packed


def test_a_layer_whose_weight_cannot_be_packed_keeps_f_linear(monkeypatch):
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = F.linear(x, layer.weight, layer.bias)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a torch without oneDNN
    method = PackedLinearMethod()
    layer.method = method
    method.process_weights_after_loading(layer)
    assert method.describe(layer) == "plain (could not pack)"
    assert torch.equal(layer(x), expected)


def bf16_packs() -> bool:
    """oneDNN packs bfloat16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT."""
    return pack_weight(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None


def packed_kind() -> str:
    """What a packed bfloat16 layer runs on this CPU."""
    return "packed" if bf16_packs() else "plain (could not pack)"


@pytest.mark.parametrize("quantized", [Int8LinearMethod, Int4LinearMethod])
def test_a_quantized_layer_with_a_packed_copy_runs_each_by_the_rows_of_the_product(quantized):
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    alone = {name: Linear.sharing(layer) for name in ("few", "many")}
    for name, method in (("few", quantized()), ("many", PackedLinearMethod())):
        alone[name].method = method
        method.process_weights_after_loading(alone[name])
    both = RowDispatchLinearMethod(quantized(), PackedLinearMethod(), max_rows=4)
    layer.method = both
    both.process_weights_after_loading(layer)
    for rows, side in ((1, "few"), (4, "few"), (5, "many"), (64, "many")):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(layer(x), alone[side](x)), (rows, side)
    assert layer(torch.randn(2, 3, 64, dtype=torch.bfloat16)).shape == (2, 3, 48)  # 6 rows, as a batch
    assert both.weight_bytes(layer) == sum(a.method.weight_bytes(a) for a in alone.values())
    few = INT8 if quantized is Int8LinearMethod else quantized.name
    assert both.describe(layer) == f"{few} up to 4 rows, else {packed_kind()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_layer_holds_only_its_packed_weight_and_gives_the_same_product(dtype):
    layer = Linear(64, 48, bias=False).to(dtype)
    x = torch.randn(5, 64, dtype=dtype)
    expected = F.linear(x, layer.weight)
    PackedLinearMethod().process_weights_after_loading(layer)
    layer.method = PackedLinearMethod()
    if dtype == torch.bfloat16 and not bf16_packs():  # this CPU: the plain weight stays, F.linear runs
        assert layer.packed_weight is None and layer.method.describe(layer) == "plain (could not pack)"
        assert torch.equal(layer(x), expected)
        return
    assert layer.weight.numel() == 0 and layer.packed_weight.is_mkldnn
    assert torch.allclose(layer(x).float(), expected.float(), atol=1e-2)


@pytest.mark.slow
def test_the_default_model_runs_its_q4_1_blocks_close_to_its_float32_model():
    reference = greedy_with_logprobs(LLM(dtype="float32", **ENGINE))
    llm = LLM(dtype="bfloat16", quantization="gguf", prepack_linear=True, **ENGINE)  # the default with AMX
    kinds = {layer.method.describe(layer) for layer in served_layers(llm).values()}
    assert kinds == {f"int4 (GGUF Q4_1 blocks) up to 8 rows, else {packed_kind()}",
                     f"{INT8} (GGUF Q8_0 requantized per row) up to 8 rows, else {packed_kind()}"}
    assert_close(reference, greedy_with_logprobs(llm))


def test_an_engine_process_given_a_gguf_file_runs_its_blocks(tiny_ggufs):
    """The cores of ``stagedserve serve`` get the model argument as given, so they know the file a
    converted directory came from (given only the directory, ``quantization="gguf"`` is refused)."""
    import asyncio

    from stage5_server.engine.mp_client import MPAsyncLLM

    path = str(tiny_ggufs["Q4_0"])
    offline = LLM(path, dtype="bfloat16", quantization="gguf", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = offline.generate(["The engine"], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = MPAsyncLLM(path, log_stats_interval=None, startup_timeout_s=120, dtype="bfloat16",
                        quantization="gguf", **ENGINE)
    try:
        async def final():
            last = None
            async for out in engine.generate("The engine", params, request_id="gguf-1"):
                last = out
            return last

        assert asyncio.run(final()).outputs[0].token_ids == expected
    finally:
        engine.shutdown()
