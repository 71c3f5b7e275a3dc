"""GGUF checkpoints: small files written with the gguf package's writer from tiny random checkpoints,
converted, and compared with the checkpoint they came from and with transformers' own GGUF load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shared.gguf import SUPPORTED_TYPES, convert_gguf, gguf_checkpoint_dir, unpermute_rope_rows
from tests.shared.gguf_files import permute_for_llama_cpp, write_gguf

TEXT = "Hello, world! Café 東京 🙂 <|im_start|>user\nAdd 4 and 5.<|im_end|>"


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def converted(gguf_file: Path, out: Path) -> Path:
    convert_gguf(gguf_file, out)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_f32_file_converts_back_to_the_checkpoint_it_was_written_from(checkpoints, gguf_dir, family):
    source = checkpoints[family]
    out = converted(write_gguf(source, gguf_dir / f"{family}-f32.gguf"), gguf_dir / f"{family}-f32")
    ours, original = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert set(ours) == set(original)
    # Bit for bit, Llama's q/k rows included: the permutation is undone exactly.
    assert all(torch.equal(ours[name], original[name]) for name in original)
    config, want = json.loads((out / "config.json").read_text()), json.loads((source / "config.json").read_text())
    for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "rope_parameters"):
        assert config[key] == want[key], key
    assert config["rms_norm_eps"] == float(np.float32(want["rms_norm_eps"]))  # GGUF stores it as float32
    from transformers import AutoTokenizer

    tokenizer, original_tokenizer = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
    assert tokenizer.encode(TEXT) == original_tokenizer.encode(TEXT)
    assert tokenizer.chat_template == original_tokenizer.chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == \
        tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weight_type", SUPPORTED_TYPES)
def test_dequantized_tensors_equal_transformers_gguf_load(checkpoints, gguf_dir, family, weight_type):
    # transformers' GGUF loader reads Qwen3's head_dim from its config defaults, not the file, so
    # it cannot load a tiny Qwen3; the F32 round trip above covers that family.
    from transformers import AutoModelForCausalLM

    path = write_gguf(checkpoints[family], gguf_dir / f"{family}-{weight_type}.gguf", weight_type)
    ours = load_file(converted(path, gguf_dir / f"{family}-{weight_type}") / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    theirs = reference.state_dict()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    if weight_type != "F32":  # quantized: close to the original weights, not equal
        original = load_file(checkpoints[family] / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
        error = (ours["model.layers.0.mlp.up_proj.weight"] - original).abs().max().item()
        assert 0 < error < 0.25 * original.abs().max().item()


def test_a_q4_1_block_reads_back_as_d_times_q_plus_m(tiny_llama, gguf_dir):
    """The layout docs/default-model.md describes: per 32 weights an fp16 scale d, an fp16 minimum m,
    then 16 bytes of 4-bit q (the low nibbles are weights 0-15, the high ones 16-31)."""
    from gguf import GGUFReader

    path = write_gguf(tiny_llama, gguf_dir / "q4_1.gguf", "Q4_1")
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    block = np.asarray(tensor.data)[0, :20]  # row 0, its first block of 2 + 2 + 16 bytes
    d, m = block[0:2].view(np.float16).astype(np.float32)[0], block[2:4].view(np.float16).astype(np.float32)[0]
    q = np.concatenate([block[4:] & 0x0F, block[4:] >> 4]).astype(np.float32)
    weights = load_file(converted(path, gguf_dir / "q4_1") / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(weights[0, :32], torch.from_numpy(d * q + m))
    assert tensor.data.nbytes * 32 == weights.numel() * 20  # 20 bytes per 32 weights: 5 bits a weight


def test_rope_row_permutation_is_undone():
    rows = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of head_dim 8
    permuted = torch.from_numpy(permute_for_llama_cpp(rows.numpy(), num_heads=2))
    assert not torch.equal(permuted, rows)
    # llama.cpp interleaves the two halves of each head: rows 0, 4, 1, 5, 2, 6, 3, 7 of head 0.
    assert permuted[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    assert torch.equal(unpermute_rope_rows(permuted, num_heads=2), rows)


def test_conversion_is_cached_by_content(tiny_llama, gguf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_llama, gguf_dir / "cached.gguf", "Q8_0")
    first = gguf_checkpoint_dir(path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_checkpoint_dir(path) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temporary directory left
    other = write_gguf(tiny_llama, gguf_dir / "cached.gguf", "Q4_0")  # same name, new content
    os.utime(other, ns=(stamp + 1, stamp + 1))
    assert gguf_checkpoint_dir(other) != first


# ---- bad files: a ValueError that names the problem ----------------------------------------------


@pytest.fixture(scope="module")
def good_bytes(tiny_llama, gguf_dir) -> bytes:
    return write_gguf(tiny_llama, gguf_dir / "good.gguf", "Q8_0").read_bytes()


@pytest.mark.parametrize("cut", [0, 3, 40, 2000, 0.5, 0.999])
def test_truncated_file_is_a_clear_error(good_bytes, tmp_path, cut):
    path = tmp_path / "cut.gguf"
    path.write_bytes(good_bytes[:cut if isinstance(cut, int) else int(cut * len(good_bytes))])
    with pytest.raises(ValueError, match=r"^model: cut\.gguf is (truncated|not a GGUF file)"):
        convert_gguf(path, tmp_path / "out")


def test_wrong_magic_is_a_clear_error(good_bytes, tmp_path):
    path = tmp_path / "ggml.gguf"
    path.write_bytes(b"GGML" + good_bytes[4:])
    with pytest.raises(ValueError, match=r"^model: ggml\.gguf is not a GGUF file \(it starts with b'GGML'"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"architecture": "mamba"}, r"is a 'mamba' model; supported GGUF architectures: \['llama', 'qwen2', 'qwen3'\]"),
    ({"tensor_types": {"blk.1.ffn_up.weight": "Q5_0"}}, r"tensor 'blk\.1\.ffn_up\.weight' in bad\.gguf is Q5_0"),
    ({"tokenizer": False}, r"has no tokenizer"),
    ({"extra_tensors": {"rope_freqs.weight": np.ones(16, np.float32)}}, r"'rope_freqs\.weight' .* has no place"),
    ({"drop_tensors": ("blk.1.attn_v.weight",)}, r"lacks tensors for \['model\.layers\.1\.self_attn\.v_proj"),
    ({"metadata": {"llama.rope.scaling.type": "yarn"}}, r"uses RoPE scaling 'yarn'"),
], ids=["architecture", "quant-type", "no-tokenizer", "unknown-tensor", "missing-tensor", "rope-scaling"])
def test_unsupported_content_is_a_clear_error(tiny_llama, tmp_path, kwargs, message):
    path = write_gguf(tiny_llama, tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ValueError, match=r"^model: .*" + message):
        convert_gguf(path, tmp_path / "out")


def test_llm_reports_a_bad_gguf_file_as_a_model_error(good_bytes, tmp_path, monkeypatch):
    from stage4_prefix_cache import LLM

    monkeypatch.setenv("STAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "half.gguf"
    path.write_bytes(good_bytes[:len(good_bytes) // 2])
    with pytest.raises(ValueError, match=r"^model: half\.gguf is truncated"):
        LLM(model=str(path))
    with pytest.raises(ValueError, match=r"^model: no GGUF file at"):
        LLM(model=str(tmp_path / "missing.gguf"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written
