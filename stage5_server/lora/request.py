"""What names an adapter: the ``LoRARequest`` a request carries, and the engine's LoRA settings.

A request that runs under an adapter carries ``LoRARequest(lora_name, lora_int_id, lora_path)``,
vLLM's own three fields: the name a client asks for (the server's ``model`` field), a number the
server gives each load, and the PEFT directory the weights come from. The workers load the
weights from ``lora_path`` the first time they meet ``(lora_int_id, lora_path)``; the prefix cache
keys a block by the name and the path (``stage4_prefix_cache/kv_cache_utils.py``).

vLLM: ``vllm/lora/request.py`` and ``LoRAConfig`` in ``vllm/config/lora.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request: lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request: lora_path must name a PEFT adapter directory, got {self.lora_path!r}")

    @property
    def key(self) -> tuple[int, str]:
        """What the workers cache the loaded weights under."""
        return self.lora_int_id, self.lora_path


@dataclass(frozen=True)
class LoRAConfig:
    """``enable_lora=True``'s settings: adapter slots per step, and the largest rank a slot holds."""

    max_loras: int = 1
    max_lora_rank: int = 16

    @classmethod
    def create(cls, enable_lora: object, max_loras: object, max_lora_rank: object) -> LoRAConfig | None:
        if enable_lora not in (True, False):
            raise ValueError(f"enable_lora: must be a bool, got {enable_lora!r}")
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        return cls(max_loras, max_lora_rank) if enable_lora else None
