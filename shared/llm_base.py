"""The offline front end every stage's ``LLM`` shares: prompts in, ``RequestOutput``s out.

A stage's ``LLM`` subclass names the engine arguments it understands and builds its
engine core; everything else (argument checks, tokenization, chat templates, the step
loop, detokenization, stop strings) lives here once. The engine core of every stage
offers the same four methods: ``add_request``, ``step``, ``has_unfinished_requests``
and ``finish_requests``.

``model`` is a checkpoint directory, a ``.gguf`` file or a name (``shared.named_models``); no
model means the default, SmolLM2-135M-Instruct. Without ``kv_cache_memory`` or an explicit pool
size the KV cache sizes itself from free memory on CPU, and a ``max_model_len`` the user did not
set comes down to what that cache holds (``set_kv_cache_capacity``) instead of failing to start.

vLLM: ``vllm/entrypoints/llm.py`` (LLM) over ``vllm/v1/engine/llm_engine.py``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch

from shared.config import ModelConfig
from shared.host_memory import available_memory
from shared.metrics import SchedulerStats
from shared.named_models import default_model, resolve_model
from shared.output_processor import OutputDelta, OutputProcessor
from shared.outputs import RequestOutput
from shared.parallel_sampling import ParentRequest
from shared.request import Request, RequestStatus
from shared.sampling_params import SamplingParams, tokenize_bad_words
from shared.structured_output import StructuredOutputManager, check_structured_outputs
from shared.tokenizer import Tokenizer
from shared.weights import load_model

logger = logging.getLogger("stagedserve")

PromptType = str | list[int] | dict


class EngineCore(Protocol):
    max_model_len: int

    def add_request(self, request: Request) -> None: ...
    def step(self) -> list[Request]: ...
    def has_unfinished_requests(self) -> bool: ...
    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None: ...
    def kv_cache_usage(self) -> float: ...
    def stats(self) -> SchedulerStats: ...


COMMON_ARGS: dict[str, Any] = {
    "tokenizer": None,  # defaults to the model directory
    "seed": 0,
    "dtype": "auto",  # float32 on CPU, bfloat16 on CUDA
    "device": None,  # "cpu" unless a later stage picks CUDA
    "max_model_len": None,  # defaults to the model's max_position_embeddings
    "max_num_seqs": 16,
    "kv_cache_memory": None,  # bytes of K/V; default: sized from free memory (automatic_kv_cache_tokens)
}
CPU_KV_CACHE_MEMORY = 4 << 30  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4)
FREE_MEMORY_FRACTION = 0.5  # the automatic KV cache takes at most this share of the available memory
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}


def check_common_args(args: dict[str, Any], model_config: ModelConfig) -> int:
    """Check ``max_num_seqs`` and ``max_model_len``; return the latter (default: the model's)."""
    max_len = args["max_model_len"] or model_config.max_position_embeddings
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_model_len: must be an integer >= 2, got {max_len!r}")
    if not isinstance(args["max_num_seqs"], int) or args["max_num_seqs"] < 1:
        raise ValueError(f"max_num_seqs: must be an integer >= 1, got {args['max_num_seqs']!r}")
    return max_len


class BaseLLM:
    stage: ClassVar[str] = "base"
    engine_args: ClassVar[dict[str, Any]] = {}  # the stage's own arguments and their defaults

    def __init__(self, model: str | None = None, **kwargs: Any):
        accepted = {**COMMON_ARGS, **self.engine_args}
        for name in kwargs:
            if name not in accepted:
                raise ValueError(f"{name}: not an engine argument of {self.stage}; accepted: {sorted(accepted)}")
        self.args = {**accepted, **kwargs}
        self.model_path = default_model() if model is None else resolve_model(model)  # a name or .gguf: a directory
        self.device = torch.device(self.args["device"] or self.default_device())
        self.dtype = self._resolve_dtype(self.args["dtype"])
        self.model, self.model_config = self._load_model()
        self.tokenizer = Tokenizer(resolve_model(self.args["tokenizer"]) if self.args["tokenizer"] else self.model_path)
        self.max_model_len = check_common_args(self.args, self.model_config)
        self.engine: EngineCore = self._build_engine()
        self._start_frontend()
        logger.info("%s engine ready: model=%s device=%s dtype=%s max_model_len=%d", self.stage,
                    self.model_path, self.device, self.dtype, self.max_model_len)

    def _start_frontend(self) -> None:
        """The offline front end over a built ``self.engine``: request ids, outputs, grammars."""
        # Compiles structured-output grammars off the engine loop; the engine schedules a request once it is ready.
        self.structured_output_manager = StructuredOutputManager(self.tokenizer.hf, self.model_config.vocab_size,
                                                                 self.model_config.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # ---- what a stage provides -------------------------------------------------------
    def _build_engine(self) -> EngineCore:
        raise NotImplementedError

    def default_device(self) -> str:
        return "cpu"

    def _load_model(self) -> tuple[Any, ModelConfig]:
        """The model and its config. A stage whose model runs in other processes returns ``None`` as the model."""
        return load_model(self.model_path, self.dtype, self.device)

    # ---- helpers for stages -----------------------------------------------------------
    def _resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {dtype!r}; choose auto or one of {sorted(DTYPES)}")
        return DTYPES[dtype]

    def kv_cache_tokens(self) -> int:
        """How many tokens of K/V the cache holds: ``kv_cache_memory`` bytes when given, else the automatic size."""
        memory = check_kv_cache_memory(self.args["kv_cache_memory"])
        per_token = kv_bytes_per_token(self.model_config, self.dtype)
        if memory is None:
            return automatic_kv_cache_tokens(per_token, self.args["max_num_seqs"], self.max_model_len)
        return memory // per_token

    def set_kv_cache_capacity(self, capacity: int, pool_arg: str, error: str) -> None:
        """Record that the KV cache holds ``capacity`` tokens and fit ``max_model_len`` to it
        (``fit_max_model_len``)."""
        self.kv_cache_capacity = capacity
        self.max_model_len = fit_max_model_len(capacity, self.max_model_len, self.args, pool_arg, error,
                                               kv_bytes_per_token(self.model_config, self.dtype))

    # ---- the public API ---------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None) -> str:
        if request_id is not None and self.output_processor.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request_id, parent, requests = self._make_requests(prompt, params or SamplingParams(), request_id,
                                                           priority, cache_salt)
        self._add(prompt, parent, requests)
        return request_id

    def _add(self, prompt: PromptType, parent: ParentRequest | None, requests: list[Request],
             final_only: bool = False) -> None:
        add_to_engine(self.engine, self.output_processor, prompt, parent, requests, final_only)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that changed (a request added by
        ``generate`` only once it finishes)."""
        processed = self.output_processor.process_outputs(self._engine_step())
        if processed.reqs_to_abort:  # stop strings ended them
            self.engine.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.outputs

    def _engine_step(self) -> list[OutputDelta]:
        """One engine step: what it added to each request the front end wants to hear of now."""
        processor = self.output_processor
        return [OutputDelta.from_request(req, processor.num_output_tokens(req.request_id)) for req in self.engine.step()
                if processor.wants_delta(req.request_id, req.is_finished)]

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests by the ids ``add_request`` returned (a parallel-sampling parent aborts its children)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        engine_ids = self.output_processor.abort_requests(ids)
        self.engine.finish_requests(engine_ids, RequestStatus.FINISHED_ABORTED)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts, params = prompts_and_params(prompts, sampling_params)
        return self._run(prompts, [self._make_requests(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def _run(self, prompts: list[PromptType], groups: list[tuple[str, ParentRequest | None, list[Request]]],
             use_tqdm: bool) -> list[RequestOutput]:
        """Add every prompt's checked requests (``groups``: ``_make_requests``'s answers, all made before any
        is added), step until all have finished, and return their final outputs in order."""
        results: dict[str, RequestOutput] = {}
        bar = progress_bar(len(groups), use_tqdm)
        try:
            for prompt, (_, parent, requests) in zip(prompts, groups):
                self._add(prompt, parent, requests, final_only=True)
            step_until_finished(self.step, [request_id for request_id, _, _ in groups], results, bar)
        except BaseException:
            pending = [request_id for request_id, _, _ in groups if request_id not in results]
            self.abort(pending)  # give back their KV before the error propagates
            raise
        finally:
            bar.close()
        return [results[request_id] for request_id, _, _ in groups]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """``generate`` on conversations rendered by the chat template (the model's, or ``chat_template``);
        a control-token string inside a message stays text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, tools=tools,
                                                      chat_template=chat_template,
                                                      chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- validation -------------------------------------------------------------------
    def _make_requests(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       ) -> tuple[str, ParentRequest | None, list[Request]]:
        """Checked engine requests for one prompt: ``(the caller's id, the parent if n > 1, requests)``.

        With ``n > 1`` the request fans out into n children (``shared/parallel_sampling.py``).
        """
        token_ids, bad_words = check_inputs(prompt, params, self.tokenizer, self.model_config.vocab_size,
                                            self.max_model_len)
        if request_id is None:
            request_id = str(next(self._ids))
            while self.output_processor.has_request(request_id):  # a caller took this one by hand
                request_id = str(next(self._ids))

        def make(rid: str, child_params: SamplingParams) -> Request:
            request = Request(rid, token_ids, child_params, priority=priority, cache_salt=cache_salt,
                              eos_token_ids=tuple(self.model_config.eos_token_ids), bad_words_token_ids=bad_words)
            self.structured_output_manager.grammar_init(request)  # with structured output: built in the background
            return request

        if params.n == 1:
            return request_id, None, [make(request_id, params)]
        parent = ParentRequest(request_id, params)
        taken = [cid for cid in parent.child_ids if self.output_processor.has_request(cid)]
        if taken:
            raise ValueError(f"request_id: the child ids of {request_id!r} ({', '.join(taken)}) are already in use")
        return request_id, parent, [make(cid, parent.child_params(i)) for i, cid in enumerate(parent.child_ids)]


def add_to_engine(engine: Any, output_processor: OutputProcessor, prompt: PromptType, parent: ParentRequest | None,
                  requests: list[Request], final_only: bool = False) -> None:
    """Hand one prompt's checked requests (one, or a parent's n children) to ``engine`` and track their outputs in
    ``output_processor``: all of them or none (a refusal takes back what was added, and raises)."""
    added = []
    try:
        for index, request in enumerate(requests):
            engine.add_request(request)
            added.append(request.request_id)
            output_processor.add_request(request.request_id, prompt if isinstance(prompt, str) else None,
                                         request.prompt_token_ids, request.sampling_params, request.arrival_time,
                                         final_only=final_only, parent=parent, index=index)
    except BaseException:
        engine.finish_requests(added, RequestStatus.FINISHED_ABORTED)
        output_processor.abort_requests(added)
        raise


def step_until_finished(step: Callable[[], list[RequestOutput]], request_ids: list[str],
                        results: dict[str, RequestOutput], bar: Any) -> None:
    """Call ``step`` until every one of ``request_ids`` has its final output in ``results`` (other requests may
    share the engine: their outputs are passed over); ``bar`` counts each."""
    mine = set(request_ids)
    while len(results) < len(mine):
        for out in step():
            if out.request_id in mine and out.finished:
                results[out.request_id] = out
                bar.update(1)


def check_inputs(prompt: PromptType, params: SamplingParams, tokenizer: Tokenizer, vocab_size: int,
                 max_model_len: int | None) -> tuple[list[int], list[list[int]]]:
    """A prompt as checked token ids (``prompt_token_ids``), and ``params.bad_words`` as checked token
    sequences; the structured-output spec checked too. A ``ValueError`` names what is wrong."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
    token_ids = prompt_token_ids(prompt, tokenizer, vocab_size, max_model_len)
    bad_words = tokenize_bad_words(params.bad_words, lambda text: tokenizer.encode(text, False))
    check_token_ids(params, bad_words, vocab_size)  # ids outside the vocabulary would fail a step
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs)  # a bad spec fails here, before any request
    return token_ids, bad_words


def check_token_ids(params: SamplingParams, bad_words_token_ids: list[list[int]], vocab_size: int) -> None:
    """Token ids in ``params`` index the logits: each must be in ``[0, vocab_size)``."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                      ("bad_words", [t for word in bad_words_token_ids for t in word])):
        outside = sorted({t for t in ids if not 0 <= t < vocab_size})
        if outside:
            raise ValueError(f"{name}: token ids {outside} are outside the vocabulary [0, {vocab_size})")


def prompt_token_ids(prompt: PromptType, tokenizer: Tokenizer, vocab_size: int, max_model_len: int | None) -> list[int]:
    """A prompt (text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``) as
    checked token ids (their length too, unless ``max_model_len`` is None); a ``ValueError`` names what is wrong."""
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown:
            raise ValueError(f"{unknown[0]}: this engine does not take it; a prompt is text, token ids, "
                             "{'prompt': text} or {'prompt_token_ids': ids}")
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt)
    else:
        raise ValueError(f"prompt: expected text or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("prompt: empty prompt; at least one token is needed")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size})")
    if max_model_len is not None:
        check_prompt_fits(len(token_ids), max_model_len)
    return token_ids


def check_prompt_fits(num_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for at least one generated token."""
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt: {num_tokens} tokens leave no room to generate within max_model_len={max_model_len}")


def check_kv_cache_memory(memory: Any) -> int | None:
    if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0):
        raise ValueError(f"kv_cache_memory: must be a positive number of bytes, got {memory!r}")
    return memory


def automatic_kv_cache_tokens(per_token: int, max_num_seqs: int, max_model_len: int, processes: int = 1) -> int:
    """The CPU default: ``min(4 GiB, half the memory available now)``, shared by ``processes``
    on this host (tensor-parallel ranks), and no more than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens fill at once (more would only keep evicted prefixes, and cost a
    block object each)."""
    free = available_memory()
    memory = min(CPU_KV_CACHE_MEMORY, int(FREE_MEMORY_FRACTION * free)) // processes
    tokens = min(memory // per_token, max_num_seqs * max_model_len)
    logger.info("KV cache sized automatically: %d tokens (%.2f GiB; %.2f GiB available)", tokens,
                tokens * per_token / 2**30, free / 2**30)
    return tokens


def fit_max_model_len(capacity: int, max_model_len: int, args: dict[str, Any], pool_arg: str, error: str,
                      per_token: int) -> int:
    """The ``max_model_len`` a KV cache of ``capacity`` tokens can serve: unchanged when one sequence
    fits; lowered to the capacity, with a warning, when the user set neither ``max_model_len`` nor the
    KV size; otherwise (or when not even 2 tokens fit) ``ValueError(error)``."""
    if capacity >= max_model_len:
        return max_model_len
    given = [name for name in ("max_model_len", "kv_cache_memory", pool_arg) if args.get(name) is not None]
    if given or capacity < 2:
        raise ValueError(error)
    logger.warning("max_model_len: lowered from %d to %d tokens, all that the automatically sized KV cache "
                   "(%.2f GiB) holds; set --max-model-len (max_model_len=) for another length, or "
                   "--kv-cache-memory (kv_cache_memory=) to give the KV cache more memory",
                   max_model_len, capacity, capacity * per_token / 2**30)
    return capacity


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


def prompts_and_params(prompts: PromptType | list[PromptType],
                       sampling_params: SamplingParams | list[SamplingParams] | None,
                       ) -> tuple[list[PromptType], list[SamplingParams]]:
    """``generate``'s arguments as one prompt and its parameters each."""
    prompts = _as_prompt_list(prompts)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
    return prompts, [p or SamplingParams() for p in params]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not isinstance(prompts, list):
        raise ValueError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
    return prompts


def progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", disable=not enabled or total == 0, leave=False)
