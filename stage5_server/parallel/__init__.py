"""Tensor parallelism: the arithmetic of one model split over several devices.

``LLM(..., tensor_parallel_size=N)`` runs N workers (``executor/multiproc.py``), each holding 1/N
of the attention heads, MLP columns, vocabulary and KV cache; each layer costs two all-reduces.
Here: ``parallel_state.py`` (the process group, collectives, which sizes divide), ``layers.py``
(the split layers), ``sharded_model.py`` (one rank's shard, read from the checkpoint).

vLLM: ``vllm/distributed/``, ``vllm/model_executor/layers/linear.py``.
"""

from stage5_server.parallel.parallel_state import check_tensor_parallel_size, tensor_parallel_shape

__all__ = ["check_tensor_parallel_size", "tensor_parallel_shape"]
