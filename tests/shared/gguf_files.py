"""Small GGUF files for the tests, written with the ``gguf`` package's own writer.

``write_gguf`` turns a Hugging Face checkpoint directory (one of the tiny random ones) into the
GGUF file llama.cpp's converter would make of it: its metadata names, the byte-level BPE vocabulary
and merges, the chat template, Llama's q/k rows permuted for llama.cpp's RoPE, and 2-D weights
quantized to the type asked for (norms stay F32, as llama.cpp keeps them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_TO_GGUF[rest]}"


def permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Llama q/k projection: rows ``[head, half, j] -> [head, j, half]``."""
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf_dir: str | Path, path: str | Path, weight_type: str = "F32", *, architecture: str | None = None,
               tensor_types: dict[str, str] | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
               drop_tensors: tuple[str, ...] = (), tokenizer: bool = True, metadata: dict | None = None) -> Path:
    """Write ``hf_dir`` as a GGUF file at ``path``. ``tensor_types`` overrides the type of single
    tensors (by GGUF name); the other keywords make broken files for the error tests."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    hf_dir, path = Path(hf_dir), Path(path)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    if tokenizer:
        _add_tokenizer(writer, AutoTokenizer.from_pretrained(hf_dir), hf_dir)
    weights = load_file(str(hf_dir / "model.safetensors"))
    for hf_name, weight in weights.items():
        name = gguf_name(hf_name)
        if name in drop_tensors:
            continue
        weight = weight.astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            weight = permute_for_llama_cpp(weight, heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            weight = permute_for_llama_cpp(weight, kv_heads)
        kind = (tensor_types or {}).get(name, weight_type if weight.ndim == 2 else "F32")
        _add_tensor(writer, name, weight, kind)
    for name, weight in (extra_tensors or {}).items():
        _add_tensor(writer, name, weight, "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer, name: str, weight: np.ndarray, kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(weight, dtype=np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)


def _add_tokenizer(writer, tokenizer, hf_dir: Path) -> None:
    raw = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids) | {t["id"] for t in raw["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if i in special else 1 for i in range(len(vocab))])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    writer.add_eos_token_id(im_end)
    writer.add_pad_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
