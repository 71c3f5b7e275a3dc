"""What names an adapter: the ``LoRARequest`` a request carries (the engine's LoRA settings are
``config/lora.py``'s).

A request that runs under an adapter carries ``LoRARequest(lora_name, lora_int_id, lora_path)``,
vLLM's own three fields: the name a client asks for (the server's ``model`` field), a number the
server gives each load, and the PEFT directory the weights come from. The server and the offline
``LLM`` hand the weights they checked to the workers (``manager.py``'s ``add_lora``); an engine
driven directly has its workers load ``lora_path`` the first time they meet ``(lora_int_id,
lora_path)``. A fourth field, ``weights_digest``, is set by whoever checked the weights (the server,
the offline ``LLM``): the SHA-256 of those weights (``adapter.py``). The prefix cache keys a block by
``cache_key`` (``core/kv_cache_manager.py``): the name and the digest, or, for a request that came
without one, the name, the load number and the path, which is what the workers hold the weights by.

vLLM: ``vllm/lora/request.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    weights_digest: str = ""  # SHA-256 of the checked weights; "" when nobody checked them yet

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request: lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request: lora_path must name a PEFT adapter directory, got {self.lora_path!r}")

    @property
    def cache_key(self) -> tuple[str, ...]:
        """What the adapter adds to a block's hash: equal only for the same adapter with the same weights."""
        if self.weights_digest:
            return self.lora_name, self.weights_digest
        return self.lora_name, str(self.lora_int_id), self.lora_path

    @property
    def key(self) -> tuple[int, str]:
        """What the workers cache the loaded weights under."""
        return self.lora_int_id, self.lora_path
