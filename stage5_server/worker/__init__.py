"""A worker and its model runner: what runs a step's forward pass, on one device or on every rank.

``worker.py`` (``Worker``: the device, the model or its shard, the KV cache, the attention
backend), ``model_runner.py`` (``ModelRunner``: inputs from the persistent batch, forward, logits,
sampling), ``input_batch.py`` (``InputBatch``: one row per running request, updated in place). What
crosses from the engine core to every worker and back is the step contract (``outputs.py``).

vLLM: ``vllm/v1/worker/`` (``gpu_worker.py``, ``gpu_model_runner.py``, ``gpu_input_batch.py``,
``block_table.py``).
"""

from stage5_server.worker.input_batch import CachedRequestState, InputBatch
from stage5_server.worker.model_runner import ModelRunner
from stage5_server.worker.worker import Worker

__all__ = ["CachedRequestState", "InputBatch", "ModelRunner", "Worker"]
