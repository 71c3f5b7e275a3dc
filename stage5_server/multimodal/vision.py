"""The vision side of a LLaVA-style model: a CLIP vision tower and the projector, in plain torch.

An image (``pixel_values [3, H, W]``, already resized and normalised by the processor) is cut into
``patch x patch`` squares, each embedded by one convolution; a class token and learned position
embeddings are added and the sequence runs through a pre-norm transformer encoder with
bidirectional attention. LLaVA takes the hidden states of one layer (``vision_feature_layer``,
-2 for LLaVA-1.5: the second to last), drops the class token (``vision_feature_select_strategy``
"default") and maps each patch to the decoder's width with a two-layer MLP (the projector). The
result, one vector per patch, replaces the image's placeholder tokens in the prompt.

vLLM: ``vllm/model_executor/models/clip.py`` (the tower) and ``llava.py``
(``LlavaMultiModalProjector``, ``_select_image_features``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from shared.config import ModelConfig
from shared.weights import checkpoint_files
from stage5_server.config.multimodal import MultiModalConfig

if TYPE_CHECKING:
    from stage5_server.config import EngineConfig

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"model: unsupported activation {name!r} (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class CLIPAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-5)
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(hidden, eps=eps), nn.LayerNorm(hidden, eps=eps)
        self.self_attn = CLIPAttention(hidden, config["num_attention_heads"])
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, config["intermediate_size"])
        self.mlp.fc2 = nn.Linear(config["intermediate_size"], hidden)
        self.act = activation(config.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """Parameter names match the checkpoint's ``vision_tower.[vision_model.]*``; only the layers up to
    the selected one are built (the rest would be computed and thrown away)."""

    def __init__(self, config: dict, num_layers: int):
        super().__init__()
        hidden, patch = config["hidden_size"], config["patch_size"]
        self.num_patches = (config["image_size"] // patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(config.get("num_channels", 3), hidden, patch, stride=patch,
                                                    bias=False)
        self.embeddings.class_embedding = nn.Parameter(torch.empty(hidden))
        self.embeddings.position_embedding = nn.Embedding(self.num_patches + 1, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-5))  # (sic: CLIP's name)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, 3, H, W]`` -> the selected layer's hidden states ``[images, 1 + patches, hidden]``."""
        patches = self.embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.embeddings.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.embeddings.position_embedding.weight[None]
        x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class LlavaVision(nn.Module):
    """Pixels -> one decoder-width vector per image token."""

    def __init__(self, config: ModelConfig, multimodal: MultiModalConfig):
        super().__init__()
        tower = multimodal.vision_config
        if tower.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"model: unsupported vision tower {tower.get('model_type')!r} (supported: CLIP)")
        layer = multimodal.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(f"model: vision_feature_layer {layer!r}: only one layer is supported")
        total = tower["num_hidden_layers"]
        # hidden_states[0] is the embedding output, hidden_states[i] the output of layer i.
        num_layers = layer if layer >= 0 else total + 1 + layer
        self.strategy = multimodal.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"model: unsupported vision_feature_select_strategy {self.strategy!r}")
        self.vision_tower = CLIPVisionTower(tower, num_layers)
        bias = multimodal.multimodal_projector_bias
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear_1 = nn.Linear(tower["hidden_size"], config.hidden_size, bias=bias)
        self.multi_modal_projector.linear_2 = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.act = activation(multimodal.projector_hidden_act)

    @property
    def num_image_tokens(self) -> int:
        return self.vision_tower.num_patches + (1 if self.strategy == "full" else 0)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, 3, H, W]`` -> ``[images, num_image_tokens, decoder hidden]``."""
        features = self.vision_tower(pixel_values)
        if self.strategy == "default":
            features = features[:, 1:]  # the class token is not an image token
        projector = self.multi_modal_projector
        return projector.linear_2(self.act(projector.linear_1(features)))


def vision_tensor_name(name: str) -> str | None:
    """The ``LlavaVision`` parameter a checkpoint tensor fills, or None for a decoder tensor."""
    name = name.removeprefix("model.")  # some transformers versions nest both under ``model.``
    if name.startswith("vision_tower."):  # llava-hf checkpoints keep CLIP's ``vision_model.`` level
        return "vision_tower." + name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return name
    return None


def load_vision_model(path: str | Path, config: ModelConfig, multimodal: MultiModalConfig, dtype: torch.dtype,
                      device: str | torch.device) -> LlavaVision:
    """The vision tower and projector of the LLaVA checkpoint at ``path`` (``config``: its decoder's)."""
    with torch.device("meta"):
        model = LlavaVision(config, multimodal)
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                short = vision_tensor_name(name)
                if short in params:  # layers past the selected one and the post-norm are skipped
                    loaded[short] = f.get_tensor(name).to(device=device, dtype=dtype)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ValueError(f"model: checkpoint {path!s} lacks vision tensors {missing[:5]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    return model.eval()


def load_vision_tower(config: EngineConfig, device: torch.device) -> LlavaVision | None:
    """A vision-language model's tower and projector; None for a text model (one rank: ``EngineConfig``
    refuses a split vision-language model)."""
    if config.multimodal is None:
        return None
    return load_vision_model(config.model_path, config.model_config, config.multimodal, config.dtype, device)


def decoder_tensor_name(name: str) -> str | None:
    """The decoder parameter a LLaVA checkpoint tensor fills (its name with ``model.`` dropped, as
    ``shared.weights.load_weights`` hands it over), or None for a vision-tower or projector tensor."""
    if name.startswith("language_model."):  # language_model.model.* (older), or model.language_model.* (newer)
        return name.removeprefix("language_model.").removeprefix("model.")
    return name if name == "lm_head.weight" else None
