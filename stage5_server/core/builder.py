"""Build an engine core from an ``EngineConfig``: the one way every entry point gets one.

``LLM``, the engine-core process, every data-parallel rank and the benchmarks call
``build_engine_core(config)``:

1. the executor starts the workers (each loads its model or shard);
2. the KV pool is sized: ``num_kv_blocks`` if given, else ``kv_cache_memory`` bytes per rank, else
   what the GPU's profile leaves (``determine_available_memory``, the tightest rank decides), else
   the CPU default (``shared.llm_base.automatic_kv_cache_tokens``, shared by the ranks on this host);
   a ``max_model_len`` the user did not set comes down to what the pool holds;
3. the scheduler of the config's runner kind (``EngineConfig.scheduler_cls``) is built over that
   pool, with the scheduler side of a KV connector if one is configured (``kv_transfer/``), and every
   worker allocates its blocks;
4. the core gets its structured-output grammar manager and, with speculative decoding, its drafter; with
   weight sync on, the member that registers weight updates and sleep among its utilities (``weight_sync/``).

vLLM: ``EngineCore.__init__`` and ``_initialize_kv_caches`` in ``vllm/v1/engine/core.py``,
``get_kv_cache_config`` in ``vllm/v1/core/kv_cache_utils.py``.
"""

from __future__ import annotations

import logging

from shared.llm_base import automatic_kv_cache_tokens, fit_max_model_len
from shared.structured_output import StructuredOutputManager
from shared.tokenizer import Tokenizer
from stage2_paged.llm import check_num_blocks, pool_too_small
from stage3_continuous.llm import check_budget_takes_a_whole_prompt
from stage4_prefix_cache.scheduler import CacheConfig
from stage5_server.attention import describe_attention_backend
from stage5_server.config import EngineConfig
from stage5_server.core.cpu_threads import configure_engine_threads
from stage5_server.core.engine_core import EngineCore
from stage5_server.core.stats import LoggingStatLogger
from stage5_server.executor import Executor, make_executor
from stage5_server.executor.abstract import resolve_obj_by_qualname
from stage5_server.kv_transfer import KVConnectorRole, make_kv_connector
from stage5_server.spec_decode import make_drafter

logger = logging.getLogger("stagedserve")


def build_engine_core(config: EngineConfig, tokenizer: Tokenizer | None = None) -> EngineCore:
    """The engine core of ``config`` (``tokenizer``: the model's, when the caller has it loaded already)."""
    if config.device.type == "cpu" and config.parallel.world_size == 1:
        configure_engine_threads(config.cpu_threads)  # the ranks of a split model share the cores instead
    logger.info("attention backend: %s (device %s)", describe_attention_backend(config.attention_backend),
                config.device)
    executor = make_executor(config)
    try:
        block_size = config.cache.block_size
        per_token = max(executor.collective_rpc("kv_bytes_per_token"))  # pipeline stages differ: the largest decides
        if per_token == 0:  # an encoder keeps no KV: the blocks only count what runs, enough for a full batch
            num_blocks = -(-config.scheduler.max_num_seqs * config.max_model_len // block_size)
        else:
            num_blocks = check_num_blocks(config.cache.num_kv_blocks
                                          or kv_cache_tokens(config, executor, per_token) // block_size)
        max_model_len = fit_max_model_len(num_blocks * block_size, config.max_model_len, config.args,
                                          "num_kv_blocks", pool_too_small(num_blocks, block_size, config.max_model_len),
                                          per_token)
        config = config.with_max_model_len(max_model_len)
        check_budget_takes_a_whole_prompt(config.args, max_model_len)
        cache_config = CacheConfig(block_size, num_blocks, shuffle_seed=config.cache.block_shuffle_seed,
                                   enable_prefix_caching=config.cache.enable_prefix_caching,
                                   prefix_caching_hash_algo=config.cache.prefix_caching_hash_algo)
        mc = config.model_config
        connector = make_kv_connector(config.kv_transfer, KVConnectorRole.SCHEDULER, block_size,
                                      per_token * block_size, executor.world_size,
                                      (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, config.dtype))
        scheduler = resolve_obj_by_qualname(config.scheduler_cls)(
            config.scheduler, cache_config, max_model_len, config.model_config.vocab_size,
            max_loras=None if config.lora is None else config.lora.max_loras,
            **({} if connector is None else {"kv_connector": connector}),
            **({} if config.multimodal is None else {"takes_images": True}))
        executor.collective_rpc("initialize_kv_cache", num_blocks, block_size, max_model_len)
    except BaseException:
        executor.shutdown()
        raise
    logger.info("KV cache: %d blocks of %d tokens (%d tokens)%s", num_blocks, block_size, num_blocks * block_size,
                f" on each of {executor.world_size} ranks" if executor.world_size > 1 else "")
    logger.info("engine core ready: model=%s device=%s dtype=%s max_model_len=%d", config.model_path, config.device,
                config.dtype, max_model_len)
    mc, interval = config.model_config, config.log_stats_interval
    tokenizer = tokenizer or Tokenizer(config.tokenizer_path)
    grammars = StructuredOutputManager(tokenizer.hf, mc.vocab_size, mc.eos_token_ids)
    core = EngineCore(config, scheduler, executor, grammars, LoggingStatLogger(interval) if interval else None,
                      make_drafter(config))
    if config.weight_sync:  # weight updates and sleep: a member of the core (its workers have the extension)
        from stage5_server.weight_sync import WeightSync

        core.weight_sync = WeightSync(core)
    return core


def kv_cache_tokens(config: EngineConfig, executor: Executor, per_token: int) -> int:
    """Tokens of K/V per rank when ``num_kv_blocks`` is not given."""
    memory = config.cache.kv_cache_memory
    if memory is None and config.device.type == "cuda":
        num_tokens = min(config.scheduler.max_num_batched_tokens, config.max_model_len)
        memory = min(executor.collective_rpc("determine_available_memory", num_tokens))
        logger.info("KV cache sized from GPU memory: %.2f GiB -> %d tokens", memory / 2**30, memory // per_token)
    if memory is None:
        return automatic_kv_cache_tokens(per_token, config.scheduler.max_num_seqs, config.max_model_len,
                                         processes=config.parallel.world_size)
    return memory // per_token
