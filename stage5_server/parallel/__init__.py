"""Tensor parallelism: one model split over several devices, one worker process per rank.

``LLM(..., tensor_parallel_size=N)`` starts N workers, each holding 1/N of the attention heads,
MLP columns, vocabulary and KV cache; each layer costs two all-reduces. The scheduler stays in
the engine process. ``parallel_state.py`` (the process group, collectives), ``layers.py`` (the
split layers), ``sharded_model.py`` (one rank's shard), ``worker.py`` / ``executor.py`` (the
processes), ``engine.py`` (the engine core whose ``execute_model`` goes through the executor).

vLLM: ``vllm/distributed/``, ``vllm/model_executor/layers/linear.py``,
``vllm/v1/executor/multiproc_executor.py``, ``vllm/v1/worker/gpu_worker.py``.
"""

from stage5_server.parallel.engine import TensorParallelEngineCore, build_tensor_parallel_engine
from stage5_server.parallel.executor import MultiprocExecutor, TensorParallelError
from stage5_server.parallel.parallel_state import check_tensor_parallel_size, tensor_parallel_shape

__all__ = ["MultiprocExecutor", "TensorParallelEngineCore", "TensorParallelError", "build_tensor_parallel_engine",
           "check_tensor_parallel_size", "tensor_parallel_shape"]
