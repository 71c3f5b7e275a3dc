"""GGUF checkpoints: a llama.cpp file, converted once into an ordinary Hugging Face directory.

A GGUF file holds everything a model needs: the config and the tokenizer (vocabulary, merges,
special ids, chat template) as key/value metadata under llama.cpp's names, and the weights,
usually quantized in blocks (Q4_1: 32 weights share an fp16 scale ``d`` and minimum ``m``, each
weight is 4 bits ``q`` and reads back as ``d * q + m``). This module reads the file with the
``gguf`` package (the reader llama.cpp publishes), dequantizes every tensor to float32, undoes
the row permutation llama.cpp's converter applies to Llama's q/k projections, and writes
``config.json``, ``model.safetensors``, the tokenizer files and ``generation_config.json`` into a
directory under ``cache_dir()`` named by the file's SHA-256. From there every stage, tensor
parallelism and the engine process load it like any other checkpoint; the conversion runs once.

vLLM: ``vllm/model_executor/model_loader/gguf_loader.py`` (which keeps the weights quantized and
runs GGUF kernels); dequantizing at load time, as here, is what transformers'
``modeling_gguf_pytorch_utils.py`` does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from shared.cache import build_once, cache_dir

logger = logging.getLogger("stagedserve")

CONVERTER_VERSION = "v1"  # bump when the converted directory changes, so old caches are not reused
# general.architecture -> the Hugging Face class this project loads.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF tensor name -> Hugging Face name ("{i}" is the layer).
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def gguf_checkpoint_dir(path: str | Path) -> Path:
    """The converted Hugging Face directory of the GGUF file at ``path``, converting it first if no
    earlier run did (atomically, safe across processes)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model: no GGUF file at {path!s}")
    stat = path.stat()
    digest = _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return build_once(cache_dir() / f"gguf-{path.stem}-{digest[:16]}-{CONVERTER_VERSION}",
                      lambda tmp: convert_gguf(path, tmp))


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a changed file hashes again
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(path: str | Path, out_dir: str | Path) -> None:
    """Write the Hugging Face checkpoint that the GGUF file at ``path`` describes into ``out_dir``."""
    from safetensors.torch import save_file

    path, out_dir = Path(path), Path(out_dir)
    reader, meta, arch = _read_supported(path)
    _check_tensors(reader, path)
    config = _config(meta, arch, reader)
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch, path)
        tensors[name] = _hf_row_order(name, torch.from_numpy(_dequantize(tensor)), arch, config).contiguous()
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
    _check_complete(tensors, config, arch, path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _save_config(config, arch, out_dir)
    _save_tokenizer(path, out_dir, meta)
    logger.info("converted %s (%s, %d tensors) into %s", path.name, arch, len(tensors), out_dir)


def read_raw_tensors(path: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """The file's weights as stored, for a loader that keeps them quantized: Hugging Face name ->
    (GGML type name, data). A block type's data is its raw bytes, one row of ``uint8`` per output
    row (Q4_1: 20 bytes for each 32 weights); F32/F16 data is the values. Llama's q/k rows are
    put back in Hugging Face order, as ``convert_gguf`` does (a row holds whole blocks, so raw rows
    move like dequantized ones)."""
    path = Path(path)
    reader, meta, arch = _read_supported(path)
    config = _config(meta, arch, reader)
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch, path)
        data = torch.from_numpy(np.array(tensor.data))  # a copy: the file is mapped read-only
        tensors[name] = (tensor.tensor_type.name, _hf_row_order(name, data, arch, config).numpy())
    return tensors


def _read_supported(path: Path):
    """The reader, the metadata and the architecture of a GGUF file of an architecture read here."""
    reader = read_gguf(path)
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"model: {path.name} is a {arch!r} model; supported GGUF architectures: "
                         f"{sorted(ARCHITECTURES)}")
    return reader, meta, arch


def _hf_row_order(name: str, rows: torch.Tensor, arch: str, config: dict) -> torch.Tensor:
    """Llama's q/k rows (weights or biases) back in Hugging Face order: GGUF keeps them permuted for its
    RoPE. A quantized weight's raw rows move the same way (a row holds whole blocks)."""
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_rope_rows(rows, config["num_attention_heads"])
    if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_rope_rows(rows, config["num_key_value_heads"])
    return rows


def read_gguf(path: Path):
    """The ``gguf`` package's reader over ``path``; a file it cannot parse is a ``ValueError``."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"model: {path.name} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader fails in many ways (struct, numpy reshape, index) on a cut file
        raise ValueError(f"model: {path.name} is truncated or corrupt; the GGUF reader says: {exc}") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(f"model: {path.name} is truncated: tensor {tensor.name!r} ends at byte {end}, "
                             f"the file has {size}")
    return reader


class _Metadata:
    """The file's key/value metadata, read one key at a time."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=...):
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"model: {self.path.name} lacks the GGUF metadata key {key!r}")
            return default
        return field.contents()

    def __contains__(self, key: str) -> bool:
        return key in self.fields


def _check_tensors(reader, path: Path) -> None:
    """Every tensor of a type this converter dequantizes, before any work is done."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"model: tensor {tensor.name!r} in {path.name} is {tensor.tensor_type.name}, "
                             f"which this converter does not dequantize; supported: {', '.join(SUPPORTED_TYPES)}")


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    # A copy: the file is mapped read-only, and F32 tensors dequantize to a view of it.
    values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions fastest first
    return values.reshape(shape)


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of a Llama q/k projection's rows.

    Hugging Face's Llama rotates the two halves of each head (dimension ``j`` pairs with
    ``j + head_dim/2``); llama.cpp rotates neighbours (``2j`` pairs with ``2j+1``), so its
    converter moves row ``half * head_dim/2 + j`` of each head to ``2j + half``. Here each head's
    rows go back: ``[head, j, half] -> [head, half, j]``.
    """
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


def _hf_name(name: str, arch: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"model: tensor {name!r} in {path.name} has no place in a {arch} model")


def _config(meta: _Metadata, arch: str, reader) -> dict:
    heads = int(meta.get(f"{arch}.attention.head_count"))
    hidden = int(meta.get(f"{arch}.embedding_length"))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"model: {meta.path.name} uses RoPE scaling {scaling!r}, which GGUF conversion "
                         "does not support")
    head_dim = meta.get(f"{arch}.attention.key_length", None) or meta.get(f"{arch}.rope.dimension_count", None)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = meta.get(f"{arch}.vocab_size", None) or (int(embed.shape[1]) if embed is not None else None)
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens"))
    tokens = {name: meta.get(f"tokenizer.ggml.{name}_token_id", None) for name in ("bos", "eos", "padding")}
    return {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.get(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length")),
        "bos_token_id": tokens["bos"], "eos_token_id": tokens["eos"],
        "pad_token_id": tokens["padding"] if tokens["padding"] is not None else tokens["eos"],
    }


def _check_complete(tensors: dict, config: dict, arch: str, path: Path) -> None:
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkv"),
                 *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    if arch == "qwen3":
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    wanted = {"model.embed_tokens.weight", "model.norm.weight"}
    wanted |= {f"model.layers.{i}.{name}" for i in range(config["num_hidden_layers"]) for name in per_layer}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise ValueError(f"model: {path.name} lacks tensors for {missing[:3]} (a {arch} model of "
                         f"{config['num_hidden_layers']} layers)")


def _save_config(config: dict, arch: str, out_dir: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    hf = AutoConfig.for_model(arch, architectures=[ARCHITECTURES[arch]], dtype="float32", **config)
    hf.save_pretrained(out_dir)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    GenerationConfig(**generation).save_pretrained(out_dir)


def _save_tokenizer(path: Path, out_dir: Path, meta: _Metadata) -> None:
    """transformers builds the tokenizer (and chat template) from the metadata; we save it as files."""
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"model: {path.name} has no tokenizer (no tokenizer.ggml.tokens metadata)")
    try:
        tokenizer = _tokenizer_from_gguf(path)
    except Exception as exc:  # a malformed vocabulary fails deep inside tokenizers
        raise ValueError(f"model: the tokenizer in {path.name} cannot be built: {exc}") from None
    tokenizer.save_pretrained(out_dir)
    # Load tokenizer.json as it is: a class named after the architecture (Qwen2Tokenizer) would
    # rebuild its own pre-tokenizer over the one the file describes. Drop load-time details.
    config_file = out_dir / "tokenizer_config.json"
    saved = json.loads(config_file.read_text())
    saved["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("gguf_file", "name_or_path", "is_local", "local_files_only"):
        saved.pop(key, None)
    config_file.write_text(json.dumps(saved, indent=2) + "\n")


def _tokenizer_from_gguf(path: Path):
    """transformers' tokenizer for the file. Its metadata reader alone when this transformers has
    one (``AutoTokenizer.from_pretrained(gguf_file=...)`` also parses every tensor and metadata
    value again, which is most of the conversion's time); else that public path."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
