"""LoRA adapters served side by side: many adapters and the base model in one batch.

A request names its adapter (``LoRARequest``, ``request.py``); the server checks a PEFT adapter
directory before it lists it (``adapter.py``); the scheduler never puts more distinct adapters in
one step than there are slots (``core/scheduler.py``); the workers hold ``max_loras`` of them in
slots and map every token row of a step to its slot (``manager.py``); each adapted projection adds
its rows' deltas with one small pair of GEMMs per adapter (``layers.py``). The adapter is part of
every block's prefix-cache key, so two adapters never share cached KV.

vLLM: ``vllm/lora/`` (``request.py``, ``lora_model.py``, ``worker_manager.py``, ``layers/``,
``punica_wrapper/``).
"""

from stage5_server.config.lora import LoRAConfig
from stage5_server.lora.adapter import LoRALoadError, LoRAModel, load_adapter, read_adapter_config
from stage5_server.lora.layers import LoRALinearMethod, LoRAMapping
from stage5_server.lora.manager import LoRAModelManager
from stage5_server.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRALinearMethod", "LoRALoadError", "LoRAMapping", "LoRAModel", "LoRAModelManager",
           "LoRARequest", "load_adapter", "read_adapter_config"]
