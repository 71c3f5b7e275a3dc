"""The offline front end every stage's ``LLM`` shares: prompts in, ``RequestOutput``s out.

A stage's ``LLM`` subclass names the engine arguments it understands and builds its
engine core; everything else (argument checks, tokenization, chat templates, the step
loop, detokenization, stop strings) lives here once. The engine core of every stage
offers the same four methods: ``add_request``, ``step``, ``has_unfinished_requests``
and ``finish_requests``.

vLLM: ``vllm/entrypoints/llm.py`` (LLM) over ``vllm/v1/engine/llm_engine.py``.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, ClassVar, Protocol

import torch

from shared.config import ModelConfig
from shared.metrics import SchedulerStats
from shared.output_processor import OutputProcessor
from shared.outputs import RequestOutput
from shared.request import Request, RequestStatus
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutputManager, check_structured_outputs
from shared.tiny_model import default_model
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
    "kv_cache_memory": None,  # bytes of K/V; default DEFAULT_KV_CACHE_MEMORY
}
DEFAULT_KV_CACHE_MEMORY = 256 << 20
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}


class BaseLLM:
    stage: ClassVar[str] = "base"
    engine_args: ClassVar[dict[str, Any]] = {}  # the stage's own arguments and their defaults

    def __init__(self, model: str | None = None, **kwargs: Any):
        accepted = {**COMMON_ARGS, **self.engine_args}
        for name in kwargs:
            if name not in accepted:
                raise ValueError(f"{name}: not an engine argument of {self.stage}; accepted: {sorted(accepted)}")
        self.args = {**accepted, **kwargs}
        self.model_path = model or default_model()
        self.device = torch.device(self.args["device"] or self.default_device())
        self.dtype = self._resolve_dtype(self.args["dtype"])
        self.model, self.model_config = self._load_model()
        self.tokenizer = Tokenizer(self.args["tokenizer"] or self.model_path)
        max_len = self.args["max_model_len"] or self.model_config.max_position_embeddings
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_model_len: must be an integer >= 2, got {max_len!r}")
        self.max_model_len = max_len
        if not isinstance(self.args["max_num_seqs"], int) or self.args["max_num_seqs"] < 1:
            raise ValueError(f"max_num_seqs: must be an integer >= 1, got {self.args['max_num_seqs']!r}")
        self.engine: EngineCore = self._build_engine()
        # Compiles structured-output grammars off the engine loop; the engine schedules a request once it is ready.
        self.structured_output_manager = StructuredOutputManager(self.tokenizer.hf, self.model_config.vocab_size,
                                                                 self.model_config.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        logger.info("%s engine ready: model=%s device=%s dtype=%s max_model_len=%d", self.stage,
                    self.model_path, self.device, self.dtype, self.max_model_len)

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
        """How many tokens of K/V the configured memory budget holds."""
        memory = self.args["kv_cache_memory"] or DEFAULT_KV_CACHE_MEMORY
        if not isinstance(memory, int) or memory <= 0:
            raise ValueError(f"kv_cache_memory: must be a positive number of bytes, got {memory!r}")
        per_token = kv_bytes_per_token(self.model_config, self.dtype)
        return memory // per_token

    # ---- the public API ---------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None) -> str:
        if request_id is not None and request_id in self.output_processor.states:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request = self._make_request(prompt, params or SamplingParams(), request_id, priority, cache_salt)
        self.engine.add_request(request)  # may still refuse it; then nothing is tracked
        self.output_processor.add_request(request, prompt if isinstance(prompt, str) else None)
        return request.request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that changed."""
        return self._step(finished_only=False)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        # With ``finished_only`` (``generate``), text is only needed at the end, so a request
        # is detokenized per step only when a stop string must be looked for.
        outputs = []
        for req in self.engine.step():
            if finished_only and not req.is_finished and not req.sampling_params.stop:
                continue
            if self.output_processor.update(req):  # a stop string ended it
                self.engine.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            output = self.output_processor.make_output(req.request_id)
            if output.finished:
                self.output_processor.remove(req.request_id)
            if output.finished or not finished_only:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self.output_processor.remove(rid)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        params = [p or SamplingParams() for p in params]
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]  # check all before adding any
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(requests), use_tqdm)
        try:
            for prompt, request in zip(prompts, requests):
                self.engine.add_request(request)
                self.output_processor.add_request(request, prompt if isinstance(prompt, str) else None)
            mine = {r.request_id for r in requests}  # other requests may share the engine
            while len(results) < len(requests):
                for out in self._step(finished_only=True):
                    if out.request_id in mine:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            pending = [r.request_id for r in requests if r.request_id not in results]
            self.abort(pending)  # give back their KV before the error propagates
            raise
        finally:
            bar.close()
        return [results[r.request_id] for r in requests]

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
    def _make_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                      priority: int = 0, cache_salt: str | None = None) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.output_processor.states:  # a caller took this one by hand
                request_id = str(next(self._ids))
        request = Request(request_id, token_ids, params, priority=priority,
                          cache_salt=cache_salt, eos_token_ids=tuple(self.model_config.eos_token_ids))
        if request.structured_output_request is not None:
            check_structured_outputs(request.structured_output_request.params)  # a bad spec fails here
            self.structured_output_manager.grammar_init(request)  # built in the background
        return request


def prompt_token_ids(prompt: PromptType, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """A prompt (text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``) as
    checked token ids; a ``ValueError`` names what is wrong."""
    if isinstance(prompt, dict):
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
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                         f"max_model_len={max_model_len}")
    return token_ids


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not isinstance(prompts, list):
        raise ValueError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
    return prompts


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", disable=not enabled or total == 0, leave=False)
