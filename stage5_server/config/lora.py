"""``enable_lora=True``'s settings: adapter slots per step and the largest rank a slot holds, checked once;
and what adapters do not combine with here.

vLLM: ``LoRAConfig`` in ``vllm/config/lora.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stage5_server.config.speculative import SpeculativeConfig


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


def check_lora_support(runner: str, pipeline_parallel_size: int, speculative: SpeculativeConfig | None) -> None:
    """What ``enable_lora`` does not combine with here, refused before anything loads."""
    if runner != "generate":
        raise ValueError("enable_lora: adapters are served by the generate runner only, not runner='pooling'")
    if pipeline_parallel_size > 1:
        raise ValueError("enable_lora: adapters are not split into pipeline stages here; use "
                         "pipeline_parallel_size=1 (tensor_parallel_size may be more)")
    if speculative is not None and speculative.method == "draft_model":
        raise ValueError("enable_lora: a draft model has no adapters; use ngram drafts or none")
