"""A draft model cut from the target itself: its first few decoder layers, its final norm and head.

Speculative decoding needs a proposer that shares the target's vocabulary and is much cheaper.
With one real model at hand, the simplest such draft is the model's own first layers followed by
its last norm and its language-model head (self-speculation, as in LayerSkip, Elhoushi et al.,
2024, and Draft & Verify, Zhang et al., 2024): no training, the same tokenizer, and a forward
pass that costs ``num_layers / L`` of the target's layers.

``write_layer_prefix_checkpoint(src, dst, num_layers)`` writes such a draft as an ordinary
checkpoint directory (``config.json`` with ``num_hidden_layers`` set, ``model.safetensors``
with the layers past ``num_layers`` left out, and the tokenizer files copied), which any loader
of Hugging Face checkpoints reads, this repository's included.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def write_layer_prefix_checkpoint(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write the first ``num_layers`` decoder layers of checkpoint ``src``, with its norm and head, to ``dst``."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers: must be an integer from 1 to the model's {total} layers, got {num_layers!r}")
    index = src / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else [p.name for p in sorted(src.glob("*.safetensors"))]
    if not files:
        raise ValueError(f"src: no *.safetensors weights in {src!s}")
    tensors = {}
    for name in files:
        with safe_open(str(src / name), framework="pt") as f:
            for key in f.keys():
                layer = _LAYER.search(key)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[key] = f.get_tensor(key).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and path.name not in _WEIGHT_FILES \
                and path.suffix != ".safetensors":
            shutil.copy2(path, dst / path.name)
    return dst
