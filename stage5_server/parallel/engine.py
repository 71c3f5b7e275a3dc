"""The engine core when the model is split over ranks: stage4's scheduler, a multiprocess executor.

Only ``execute_model`` changes: each step is prepared here once, sent to every rank, and rank 0's
logits are sampled here with each request's own generator, so the tokens are those of
``tensor_parallel_size=1``. The KV budget is per rank (a rank stores only its own KV heads);
on a CPU without ``kv_cache_memory`` the ranks split the automatic host budget.

vLLM: ``vllm/v1/engine/core.py`` over ``vllm/v1/executor/multiproc_executor.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shared.config import ModelConfig
from shared.llm_base import kv_bytes_per_token
from shared.model_runner import prepare_inputs
from shared.sampler import sample
from stage2_paged.llm import check_block_size, check_pool_holds_one_sequence
from stage3_continuous.engine import kv_layout, scheduled_batch
from stage3_continuous.llm import check_budget_takes_a_whole_prompt
from stage4_prefix_cache import EngineCore, Scheduler, SchedulerOutput, StatsLogger
from stage5_server.attention.memory import profiled_kv_memory
from stage5_server.parallel.executor import MultiprocExecutor
from stage5_server.parallel.parallel_state import resolve_interface, tensor_parallel_shape
from stage5_server.parallel.sharded_model import rank_config
from stage5_server.parallel.worker import StepBatch

logger = logging.getLogger("stagedserve")


class TensorParallelEngineCore(EngineCore):
    def __init__(self, executor: MultiprocExecutor, scheduler: Scheduler, block_size: int, seed: int = 0,
                 stats_logger: StatsLogger | None = None):
        # Not EngineCore.__init__: there is no model in this process to install a backend on.
        self.executor = executor
        self.scheduler = scheduler
        self.block_size = block_size
        self.max_model_len = scheduler.max_model_len
        self.device = torch.device("cpu")  # where the step is prepared and sampled
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded sampled requests, as ModelRunner
        self.stats_logger = stats_logger
        self.step_trace: list[dict[str, int]] | None = None

    def execute_model(self, output: SchedulerOutput) -> dict[str, int]:
        batch = scheduled_batch(output)
        inputs = prepare_inputs(batch)
        slots, tables = kv_layout(batch, output.block_tables, self.block_size)
        step = StepBatch(inputs.input_ids.tolist(), inputs.positions.tolist(), slots, inputs.query_start_loc,
                         inputs.seq_lens, tables, [inputs.query_start_loc[r + 1] - 1 for r in inputs.sample_rows])
        logits = self.executor.execute_model(step)
        if logits is None:
            return {}
        requests = [batch[r][0] for r in inputs.sample_rows]
        return {req.request_id: tok for req, tok in zip(requests, sample(logits, requests, self.generator))}

    def shutdown(self) -> None:
        self.executor.shutdown()


def kv_bytes_per_token_per_rank(config: ModelConfig, world_size: int, dtype: torch.dtype) -> int:
    """K and V of one token across all layers, on one rank (its own KV heads only)."""
    return kv_bytes_per_token(rank_config(config, tensor_parallel_shape(config, world_size)), dtype)


def build_tensor_parallel_engine(llm, make_scheduler: Callable[[int, int], Scheduler],
                                 stats_logger: StatsLogger | None) -> TensorParallelEngineCore:
    """Start the ranks, size the KV cache per rank, build the scheduler with
    ``make_scheduler(block_size, num_blocks)``; the same checks as the one-device engine."""
    args, world_size = llm.args, llm.tensor_parallel_size
    block_size = check_block_size(args["block_size"])
    interface = resolve_interface(args["distributed_interface"])
    executor = MultiprocExecutor(llm.model_path, world_size, llm.dtype, llm.device.type, interface)
    try:
        num_blocks = args["num_kv_blocks"] or _kv_cache_tokens(llm, executor) // block_size
        check_pool_holds_one_sequence(llm, num_blocks, block_size)
        check_budget_takes_a_whole_prompt(args, llm.max_model_len)
        scheduler = make_scheduler(block_size, num_blocks)
        executor.collective_rpc("init_kv_cache", num_blocks, block_size, llm.attention_backend_name)
    except BaseException:
        executor.shutdown()
        raise
    logger.info("tensor parallel: %d ranks, attention backend %s, KV cache %d blocks of %d tokens on each rank",
                world_size, llm.attention_backend_name, num_blocks, block_size)
    return TensorParallelEngineCore(executor, scheduler, block_size, args["seed"], stats_logger)


def _kv_cache_tokens(llm, executor: MultiprocExecutor) -> int:
    per_token = kv_bytes_per_token_per_rank(llm.model_config, llm.tensor_parallel_size, llm.dtype)
    memory = llm.args["kv_cache_memory"]
    if memory is None and llm.device.type == "cuda":  # the tightest rank decides
        memory = profiled_kv_memory(llm.args, llm.max_model_len,
                                    lambda n, u: min(executor.collective_rpc("profile_kv_memory", n, u)))
    if memory is None:  # CPU: the ranks share this host's free memory
        return llm.automatic_kv_cache_tokens(per_token, processes=llm.tensor_parallel_size)
    if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
        raise ValueError(f"kv_cache_memory: must be a positive number of bytes, got {memory!r}")
    return memory // per_token
