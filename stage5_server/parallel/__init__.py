"""Model parallelism: one model split over several devices, across each layer and along the layers.

``LLM(..., tensor_parallel_size=N)`` runs N workers (``executor/multiproc.py``), each holding 1/N
of the attention heads, MLP columns, vocabulary and KV cache; each layer costs two all-reduces.
``pipeline_parallel_size=P`` cuts the layers into P stages that hand their hidden states on, once
per step. Here: ``parallel_state.py`` (the process groups, collectives, which sizes divide),
``layers.py`` (the split layers), ``sharded_model.py`` (one rank's shard, read from the
checkpoint), ``pipeline.py`` (one stage's layers and the hand-over).

vLLM: ``vllm/distributed/``, ``vllm/model_executor/layers/linear.py``.
"""

from stage5_server.parallel.parallel_state import check_tensor_parallel_size, tensor_parallel_shape

__all__ = ["check_tensor_parallel_size", "tensor_parallel_shape"]
