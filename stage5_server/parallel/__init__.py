"""Tensor parallelism: one model split over several devices, one worker process per rank.

``LLM(..., tensor_parallel_size=N)`` starts N workers that each hold 1/N of the attention heads,
the MLP columns, the vocabulary and the KV cache; each layer costs two all-reduces. The
scheduler stays in the engine process and sends every step to all ranks.

- ``parallel_state.py``: the process group (loopback by default), shapes, collectives
- ``layers.py``: column/row-parallel linear, vocab-parallel embedding and LM head
- ``sharded_model.py``: one rank's shard of ``shared``'s model, read from the checkpoint
- ``worker.py`` / ``executor.py``: the worker processes and how the engine drives them
- ``engine.py``: the engine core whose ``execute_model`` goes through the executor

vLLM: ``vllm/distributed/``, ``vllm/model_executor/layers/linear.py``,
``vllm/v1/executor/multiproc_executor.py``, ``vllm/v1/worker/gpu_worker.py``.
"""

from stage5_server.parallel.engine import TensorParallelEngineCore, build_tensor_parallel_engine
from stage5_server.parallel.executor import MultiprocExecutor, TensorParallelError
from stage5_server.parallel.parallel_state import check_tensor_parallel_size, tensor_parallel_shape

__all__ = ["MultiprocExecutor", "TensorParallelEngineCore", "TensorParallelError", "build_tensor_parallel_engine",
           "check_tensor_parallel_size", "tensor_parallel_shape"]
