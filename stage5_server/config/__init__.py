"""One typed, validated engine configuration: every engine argument checked once, before anything loads.

``EngineConfig.create(model, **engine_args)`` takes the names ``LLM(...)`` and ``stagedserve serve``
accept (stage 4's, plus stage 5's own below), refuses an unknown one or a bad value with a
``ValueError`` naming it, resolves what "auto" means (device, dtype, attention backend, the
network interface of tensor-parallel traffic) and groups the rest as vLLM does (cache, scheduler,
parallel, speculative decoding). Everything downstream (``core/builder.py``, the workers, the engine process, data
parallel ranks) reads this object and checks nothing again. The one value that can still change
is ``max_model_len``: the builder lowers it when the user set no length and the automatically
sized KV cache holds less.

Each system's own settings are a module of this package, as vLLM's are: ``model.py`` (which
checkpoint, and what it is), ``multimodal.py``, ``pooler.py``, ``speculative.py``, ``lora.py``,
``weight_sync.py``. The rooms that implement the systems read them; this package imports none of those
rooms.

The names and defaults come from one table, ``ENGINE_ARG_TABLE``: an ``EngineArg`` per argument, with
what ``stagedserve serve`` needs to make its flag of it (how a value parses, choices, short aliases,
help). Arguments of earlier stages keep their defaults from their stage (``inherited``).

vLLM: ``VllmConfig`` in ``vllm/config/__init__.py`` (``ModelConfig``, ``CacheConfig``,
``SchedulerConfig``, ``ParallelConfig``), built from ``EngineArgs`` in ``vllm/engine/arg_utils.py``
(whose ``add_cli_args`` makes the flags of its fields, as ``cli/serve.py`` does of this table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shared.config import ModelConfig
from shared.llm_base import COMMON_ARGS, DTYPES, check_common_args, check_kv_cache_memory
from shared.named_models import default_model, default_model_file
from stage2_paged.llm import check_block_size, check_num_blocks
from stage3_continuous.config import SchedulerConfig
from stage4_prefix_cache.kv_cache_utils import get_hash_fn
from stage4_prefix_cache.llm import PREFIX_CACHING_ARGS
from stage5_server.arg_types import fraction, parse_size, positive_float, positive_int
from stage5_server.attention import resolve_attention_backend
from stage5_server.config.kv_transfer import KVTransferConfig, check_kv_transfer_support, kv_transfer_config_arg
from stage5_server.config.lora import LoRAConfig, check_lora_support
from stage5_server.config.model import read_model_config, resolve_model
from stage5_server.config.multimodal import MultiModalConfig
from stage5_server.config.pooler import CONVERTS, RUNNERS, PoolerConfig, pooling_args, resolve_runner
from stage5_server.config.speculative import SpeculativeConfig, check_draft_model, speculative_config_arg
from stage5_server.config.weight_sync import check_weight_sync, weight_sync_extension
from stage5_server.parallel.parallel_state import (
    check_pipeline_parallel_size,
    check_tensor_parallel_size,
    resolve_interface,
)
from stage5_server.quantization import QUANTIZATION_METHODS, LinearConfig, resolve_linear_config, source_gguf_file
from stage5_server.quantization.config import NO_QUANTIZATION

STAGE = "stage5_server"
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, NO_QUANTIZATION)
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class EngineArg:
    """One engine argument: its name and default, and how ``stagedserve serve`` takes it from a command line
    (vLLM: a field of ``EngineArgs`` and the flag ``add_cli_args`` makes of it). The flag's own default is
    None, so only the flags given reach the engine and the default here applies otherwise."""

    name: str
    default: Any
    help: str | None = None
    type: Callable[[str], Any] | None = None  # parses a command-line value (arg_types.py); None: the string
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # short spellings after the long one: -tp, -pp, -q
    is_flag: bool = False  # a bool: --x / --no-x (argparse.BooleanOptionalAction)
    metavar: str | None = None
    cli: bool = True  # False: not a flag of stagedserve serve (the entry says why)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_EARLIER_STAGE_ARGS = {**COMMON_ARGS, **PREFIX_CACHING_ARGS}


def inherited(name: str, **cli: Any) -> EngineArg:
    """An argument of an earlier stage: the default stays its stage's, this table adds the flag's details."""
    return EngineArg(name, _EARLIER_STAGE_ARGS[name], **cli)


# In the order of the flags in ``stagedserve serve --help``.
ENGINE_ARG_TABLE: tuple[EngineArg, ...] = (
    inherited("max_model_len", type=positive_int),  # None: the model's max_position_embeddings
    inherited("max_num_seqs", type=positive_int),
    inherited("max_num_batched_tokens", type=positive_int),
    inherited("max_num_active_seqs", type=positive_int,
              help="the most requests running at once, each holding its KV blocks (default: --max-num-seqs)"),
    inherited("enable_chunked_prefill", is_flag=True,
              help="run a long prompt's prefill in chunks within each step's token budget (default: on; off for "
                   "an encoder)"),
    # The server's requests carry no priority, so "priority" would order them as "fcfs" does.
    inherited("scheduling_policy", cli=False),
    inherited("block_size", type=positive_int),
    inherited("enable_prefix_caching", is_flag=True),
    # The alternative, "fast", is a 64-bit non-cryptographic hash: a collision across tenants is a leak.
    inherited("prefix_caching_hash_algo", cli=False),
    EngineArg("gpu_memory_utilization", 0.9, type=fraction),
    EngineArg("kv_offloading_size", None, type=positive_float, metavar="GiB",  # kv_transfer/offload.py
              help="keep blocks evicted from the KV pool in a second tier of this many GiB of host memory, "
                   "summed over the ranks (default: off)"),
    EngineArg("kv_transfer_config", None, type=kv_transfer_config_arg, metavar="JSON",  # kv_transfer/
              help='the KV connector, e.g. \'{"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", '
                   '"kv_connector_extra_config": {"kv_port": 14579}}\' (vLLM\'s keys; default: none)'),
    inherited("kv_cache_memory", type=parse_size, help="bytes of K/V, e.g. 2GiB"),
    inherited("num_kv_blocks", type=positive_int),  # None: from kv_cache_memory, or sized automatically
    inherited("block_shuffle_seed", cli=False),  # the tests' check that physical block order does not matter
    inherited("tokenizer", help="tokenizer directory or name (default: MODEL's own)"),
    inherited("dtype", choices=DTYPE_CHOICES),
    inherited("device", help="cpu, cuda, cuda:1, ..."),
    EngineArg("attention_backend", None, help="torch, triton or cpu (default: the device's)"),
    # None: the compiled step on the CPU fast path (model/compile.py); True: eager
    EngineArg("enforce_eager", None, is_flag=True,
              help="run every step eagerly; default: on a CPU in bfloat16, every step runs a graph compiled at "
                   "start-up (--no-enforce-eager: in float32 too)"),
    EngineArg("compile_in_background", None, is_flag=True,  # None: at start-up; stagedserve serve: in the background
              help="compile the compiled step in a thread while the first steps run eagerly, instead of before "
                   "the engine is ready (default: on for stagedserve serve)"),
    EngineArg("cpu_threads", None, type=positive_int,
              help="torch threads of the engine on a CPU (default: one per physical core)"),
    EngineArg("speculative_config", None, type=speculative_config_arg, metavar="JSON",  # None: off
              help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4}\' (vLLM\'s keys; default: off)'),
    EngineArg("runner", "auto", choices=RUNNERS,  # auto: pooling for an encoder (pooling/config.py)
              help="generate tokens, or pool each input into a vector (embeddings, score, rerank); default auto: "
                   "pooling for an encoder checkpoint such as BERT"),
    EngineArg("convert", "auto", choices=CONVERTS,
              help="embed: serve a decoder as an embedding model (its last token, normalized)"),
    EngineArg("quantization", None, choices=QUANTIZATION_CHOICES, aliases=("-q",),  # quantization/config.py
              help="gguf: a .gguf model's Q4_0/Q4_1 blocks as int4 linears; int8/int4: weight-only, quantized at "
                   "load; none: the float weights (CPU; default: as measured, docs/performance.md)"),
    EngineArg("prepack_linear", None, is_flag=True,
              help="run float linears on weights packed once for oneDNN (CPU; default: as measured)"),
    EngineArg("enable_lora", False, is_flag=True,  # lora/
              help="serve LoRA adapters beside the base model (the request's model field names one)"),
    EngineArg("max_loras", 1, type=positive_int, help="distinct adapters in one step: the adapter slots (default: 1)"),
    EngineArg("max_lora_rank", 16, type=positive_int, help="the largest adapter rank a slot holds (default: 16)"),
    EngineArg("enable_weight_sync", False, is_flag=True,  # weight_sync/
              help="take new weights and sleep while serving, for RL post-training: collective_rpc reaches the "
                   "workers' weight-update methods (default: off; --enable-dev-routes turns it on)"),
    inherited("seed", type=int),
    EngineArg("tensor_parallel_size", 1, type=positive_int, aliases=("-tp",), help="split each layer over N devices"),
    EngineArg("pipeline_parallel_size", 1, type=positive_int, aliases=("-pp",),  # parallel/pipeline.py
              help="split the layers into P stages, one batch in flight per stage (default: 1)"),
    EngineArg("distributed_executor_backend", None, choices=DISTRIBUTED_EXECUTOR_BACKENDS,  # None: mp
              help="where the ranks of a split model run: mp, processes on this host (default); ray, actors on "
                   "the Ray cluster of RAY_ADDRESS (hosts joined with ray start)"),
    # None: the interface with VLLM_HOST_IP, or loopback
    EngineArg("distributed_interface", None, metavar="IFACE",
              help="network interface of the ranks' unauthenticated traffic (default: loopback); never one "
                   "reachable from an untrusted network"),
    inherited("log_stats_interval", cli=False),  # serve's own --log-stats-interval (default 10, 0: off) sets it
    EngineArg("enable_inspector", False, is_flag=True,  # inspector/
              help="record every engine step for the inspector page, GET /inspect, and its event stream "
                   "(default: off)"),
)
ENGINE_ARGS = {arg.name: arg.default for arg in ENGINE_ARG_TABLE}
SERVER_ENGINE_ARGS = {name: default for name, default in ENGINE_ARGS.items() if name not in COMMON_ARGS}
# bfloat16 pays on a CPU with native bf16 (AMX, AVX512-BF16) once the GEMMs are wide enough:
# measured faster than float32 from SmolLM2-135M's hidden 576 up, slower for the random
# checkpoints of hidden 128 and 256 (oneDNN's per-call cost dominates there; performance page).
CPU_BF16_MIN_HIDDEN_SIZE = 512
# Each runner kind's scheduler and worker, by qualified name: the builder and every executor build them from
# here without importing the room they live in (vLLM: ``SchedulerConfig.scheduler_cls``,
# ``ParallelConfig.worker_cls``).
RUNNER_KINDS = {"generate": ("stage5_server.core.scheduler:Scheduler", "stage5_server.worker.worker:Worker"),
                "pooling": ("stage5_server.pooling.scheduler:PoolingScheduler",
                            "stage5_server.pooling.worker:make_pooling_worker")}


@dataclass(frozen=True)
class CacheSettings:
    """How the paged KV cache is sized and shared (vLLM's ``CacheConfig``)."""

    block_size: int
    num_kv_blocks: int | None  # None: from kv_cache_memory, or sized automatically
    kv_cache_memory: int | None  # bytes of K/V per rank
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    block_shuffle_seed: int | None


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    distributed_interface: str | None  # resolved when there are ranks: the loopback interface unless one is named
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "mp": processes on this host; "ray": actors on a Ray cluster

    @property
    def world_size(self) -> int:
        """Worker processes: one per (pipeline stage, tensor-parallel rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tokenizer_path: str
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    seed: int
    max_model_len: int
    scheduler: SchedulerConfig
    cache: CacheSettings
    parallel: ParallelConfig
    attention_backend: str  # a name in ATTENTION_BACKENDS
    enforce_eager: bool | None
    compile_step: bool  # every step runs a graph compiled at start-up (model/compile.py)
    compile_in_background: bool  # ... compiled in a thread while the first steps run eagerly
    cpu_threads: int | None
    log_stats_interval: float | None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    runner: str = "generate"  # "generate" | "pooling" (pooling/)
    pooler: PoolerConfig | None = None  # how the pooling runner pools; None when generating
    linear: LinearConfig = LinearConfig(None, False, None)  # each linear layer's method: quantization/
    lora: LoRAConfig | None = None  # None: no adapters (lora/)
    multimodal: MultiModalConfig | None = None  # a vision-language model's vision side (multimodal/); None: text only
    kv_transfer: KVTransferConfig | None = None  # the KV connector (kv_transfer/); None: none
    weight_sync: bool = False  # weight updates and sleep (weight_sync/): members of the core, front end and workers
    args: dict[str, Any] = field(default_factory=dict)  # every engine argument as given, defaults filled in

    @classmethod
    def create(cls, model: str | None = None, **engine_args: Any) -> EngineConfig:
        for name in engine_args:
            if name not in ENGINE_ARGS:
                raise ValueError(f"{name}: not an engine argument of stage5_server; accepted: {sorted(ENGINE_ARGS)}")
        args = {**ENGINE_ARGS, **engine_args}
        model_path = default_model() if model is None else resolve_model(model)  # a name or .gguf: a directory
        model_config, multimodal = read_model_config(model_path)
        device = torch.device(args["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(args["dtype"], device, model_config)
        runner = resolve_runner(args["runner"], args["convert"], model_config)
        pooler = PoolerConfig.from_checkpoint(model_path, model_config) if runner == "pooling" else None
        if pooler is not None:
            args = {**args, **pooling_args(args, model_config, pooler)}
        max_model_len = check_common_args(args, model_config)
        pipeline_parallel_size = check_pipeline_parallel_size(args["pipeline_parallel_size"], model_config)
        tensor_parallel_size = check_tensor_parallel_size(args["tensor_parallel_size"], model_config, device,
                                                          pipeline_parallel_size)
        world_size = tensor_parallel_size * pipeline_parallel_size
        backend = args["distributed_executor_backend"] or "mp"
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend: must be 'mp' or 'ray', got {backend!r}")
        for flag in ("enforce_eager", "compile_in_background"):
            if args[flag] not in (None, True, False):
                raise ValueError(f"{flag}: must be a bool, got {args[flag]!r}")
        cpu_threads = args["cpu_threads"]
        if cpu_threads is not None and (not isinstance(cpu_threads, int) or cpu_threads < 1):
            raise ValueError(f"cpu_threads: must be a positive integer, got {cpu_threads!r}")
        utilization = args["gpu_memory_utilization"]
        if not isinstance(utilization, (int, float)) or isinstance(utilization, bool) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization!r}")
        for name in ("enable_prefix_caching", "enable_inspector"):
            if not isinstance(args[name], bool):
                raise ValueError(f"{name}: must be a bool, got {args[name]!r}")
        get_hash_fn(args["prefix_caching_hash_algo"])  # a clear error for an unknown name
        num_kv_blocks = args["num_kv_blocks"]
        if num_kv_blocks is not None:
            check_num_blocks(num_kv_blocks)
        scheduler = SchedulerConfig(max_num_batched_tokens=args["max_num_batched_tokens"],
                                    max_num_seqs=args["max_num_seqs"],
                                    max_num_active_seqs=args["max_num_active_seqs"],
                                    enable_chunked_prefill=args["enable_chunked_prefill"],
                                    policy=args["scheduling_policy"])
        cache = CacheSettings(block_size=check_block_size(args["block_size"]), num_kv_blocks=num_kv_blocks,
                              kv_cache_memory=check_kv_cache_memory(args["kv_cache_memory"]),
                              gpu_memory_utilization=float(utilization),
                              enable_prefix_caching=args["enable_prefix_caching"],
                              prefix_caching_hash_algo=args["prefix_caching_hash_algo"],
                              block_shuffle_seed=args["block_shuffle_seed"])
        speculative = SpeculativeConfig.create(args["speculative_config"])
        if runner == "pooling" and (speculative is not None or world_size > 1):
            raise ValueError("runner: the pooling runner runs on one device without speculative decoding "
                             "(tensor_parallel_size=1, pipeline_parallel_size=1, no speculative_config)")
        if pipeline_parallel_size > 1 and speculative is not None:
            raise ValueError("speculative_config: speculative decoding runs without pipeline parallelism "
                             f"(pipeline_parallel_size is {pipeline_parallel_size})")
        check_draft_model(speculative, model_config, tensor_parallel_size)
        if multimodal is not None and (world_size > 1 or runner == "pooling"):
            raise ValueError("model: a vision-language model generates on one device (tensor_parallel_size=1, "
                             "pipeline_parallel_size=1, runner='generate')")
        interface = resolve_interface(args["distributed_interface"]) if world_size > 1 else None
        linear = resolve_linear_config(args["quantization"], args["prepack_linear"],
                                       source_gguf_file(model, default_model_file), device, dtype, model_config,
                                       world_size)
        lora = LoRAConfig.create(args["enable_lora"], args["max_loras"], args["max_lora_rank"])
        if lora is not None:
            check_lora_support(runner, pipeline_parallel_size, speculative)
        kv_transfer = KVTransferConfig.create(args["kv_transfer_config"], args["kv_offloading_size"])
        check_kv_transfer_support(kv_transfer, runner=runner, enable_prefix_caching=args["enable_prefix_caching"],
                                  hash_algo=args["prefix_caching_hash_algo"], world_size=world_size)
        attention_backend = resolve_attention_backend(args["attention_backend"], device)
        compile_step = resolve_compile_step(args["enforce_eager"], device, dtype, attention_backend, world_size,
                                            runner)
        return cls(model_path=model_path, tokenizer_path=resolve_model(args["tokenizer"]) if args["tokenizer"]
                   else model_path, model_config=model_config, device=device, dtype=dtype, seed=args["seed"],
                   max_model_len=max_model_len, scheduler=scheduler, cache=cache,
                   parallel=ParallelConfig(tensor_parallel_size, interface, pipeline_parallel_size, backend),
                   attention_backend=attention_backend, enforce_eager=args["enforce_eager"],
                   compile_step=compile_step, compile_in_background=bool(args["compile_in_background"]),
                   cpu_threads=cpu_threads,
                   log_stats_interval=args["log_stats_interval"], speculative=speculative, runner=runner,
                   pooler=pooler, linear=linear, lora=lora, multimodal=multimodal, kv_transfer=kv_transfer,
                   weight_sync=check_weight_sync(args["enable_weight_sync"]), args=args)

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        return replace(self, max_model_len=max_model_len)

    @property
    def scheduler_cls(self) -> str:
        return RUNNER_KINDS[self.runner][0]

    @property
    def worker_cls(self) -> str:
        return RUNNER_KINDS[self.runner][1]

    @property
    def worker_extension_cls(self) -> str | None:
        """The class each rank builds over its worker, whose methods ``collective_rpc`` also reaches; None: none."""
        return weight_sync_extension(self.weight_sync)


def resolve_compile_step(enforce_eager: bool | None, device: torch.device, dtype: torch.dtype,
                         attention_backend: str, world_size: int, runner: str) -> bool:
    """Whether steps run graphs compiled at start-up (``model/compile.py``). It needs the ``cpu``
    attention backend's operator, one rank and the generate runner. Left unset: on the CPU fast path
    (bfloat16); float32, the token-identical reference, stays eager unless ``enforce_eager=False``
    asks. With adapters, a step that runs one runs eagerly (``worker/worker.py``)."""
    if enforce_eager is True:
        return False
    supported = device.type == "cpu" and attention_backend == "cpu" and world_size == 1 and runner == "generate"
    if enforce_eager is False and not supported:
        raise ValueError("enforce_eager=False: the compiled step runs on a CPU with the cpu attention "
                         f"backend, one rank and the generate runner (here: device {device.type}, attention "
                         f"backend {attention_backend}, {world_size} rank(s), runner {runner}); leave it unset")
    return supported and (enforce_eager is False or dtype == torch.bfloat16)


def cpu_has_native_bf16() -> bool:
    """AMX tiles or AVX512-BF16: bfloat16 matrix multiplies in hardware."""
    cpu = getattr(torch, "cpu", None)
    return bool(cpu and (getattr(cpu, "_is_amx_tile_supported", lambda: False)()
                         or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()))


def cpu_auto_dtype(config: ModelConfig) -> torch.dtype:
    """What ``dtype="auto"`` means on a CPU for this model."""
    if cpu_has_native_bf16() and config.hidden_size >= CPU_BF16_MIN_HIDDEN_SIZE:
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, ``cpu_auto_dtype`` on a CPU; else a name from ``DTYPES``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return cpu_auto_dtype(config) if device.type == "cpu" else \
            torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r}; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]
