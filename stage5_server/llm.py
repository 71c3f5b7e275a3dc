"""``LLM`` for stage5: the offline API over an engine core built from one config, in this process.

Where stages 1-4 build their engine by subclassing the stage before, stage 5 builds it as vLLM V1
does: ``EngineConfig.create`` checks every argument once (``config/``) and ``build_engine_core``
starts the workers and sizes the KV cache (``core/builder.py``). The front end is the server's:
``InputProcessor`` turns every kind of prompt into engine requests (``engine/input_processor.py``) and
``OutputProcessor`` turns the core's outputs into ``RequestOutput``s (``engine/output_processor.py``).
``generate`` reads top to bottom in this file: every prompt checked into engine requests, all added,
the core stepped (``step``) until each has finished. The core steps when this process calls ``step``:
vLLM's ``LLMEngine`` over an in-process core client. Stages 1-4 share another front end
(``shared/llm_base.py``), whose argument checks and progress bar this one reuses.

New in stage 5 underneath: the attention-backend registry (``attention/``), CUDA by default when
present (bf16), a KV cache sized from free GPU memory, a persistent input batch (``worker/``), the
model rearranged for speed (``model/``), one torch thread per physical core on a CPU with
``dtype="auto"`` bfloat16 where it wins, ``tensor_parallel_size=N`` (``executor/``, ``parallel/``),
LoRA adapters (``enable_lora=True``, ``generate(..., lora_request=LoRARequest(name, id, path))``,
``lora/``), a pooling runner with ``embed`` and ``score`` for embedding models (``pooling/``), and
images in a prompt for a vision-language model (``multimodal/``): ``generate({"prompt": ...,
"multi_modal_data": {"image": image}})`` as vLLM takes them, and ``chat`` with image content parts
(``image_pil``, or an ``image_url`` holding a ``data:`` URL); ``collective_rpc`` on every worker; and, with
``enable_weight_sync=True``, serving while a trainer updates the weights (``update_weights*``, ``sleep`` /
``wake_up``: ``weight_sync/``).

vLLM: ``vllm/entrypoints/llm.py`` over ``vllm/v1/engine/llm_engine.py`` (``InprocClient`` in
``core_client.py``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from shared.llm_base import PromptType, add_to_engine, progress_bar, prompts_and_params, step_until_finished
from shared.outputs import RequestOutput
from shared.parallel_sampling import ParentRequest
from shared.request import RequestStatus
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer
from stage5_server.config import ENGINE_ARGS, SERVER_ENGINE_ARGS, STAGE, EngineConfig
from stage5_server.core import EngineCore, build_engine_core
from stage5_server.core.request import Request
from stage5_server.engine.input_processor import InputProcessor
from stage5_server.engine.output_processor import OutputProcessor
from stage5_server.errors import StepFailed
from stage5_server.lora import LoRARequest, load_adapter
from stage5_server.multimodal.processor import ImageProcessor
from stage5_server.pooling.offline import NOT_GENERATING, PoolingAPI

if TYPE_CHECKING:
    from stage5_server.weight_sync import WeightSync


class LLM(PoolingAPI):
    stage = STAGE
    engine_args = SERVER_ENGINE_ARGS

    def __init__(self, model: str | None = None, **kwargs: Any):
        config = EngineConfig.create(model, **kwargs)
        self.tokenizer = Tokenizer(config.tokenizer_path)
        self.engine: EngineCore = build_engine_core(config, self.tokenizer)
        self.config = config = self.engine.config  # with max_model_len as the KV cache allows
        self.args = {**ENGINE_ARGS, **config.args}
        self.model_path, self.model_config = config.model_path, config.model_config
        self.device, self.dtype, self.max_model_len = config.device, config.dtype, config.max_model_len
        self.attention_backend_name = config.attention_backend
        self.tensor_parallel_size = config.parallel.tensor_parallel_size
        self.pipeline_parallel_size = config.parallel.pipeline_parallel_size
        self.kv_cache_capacity = self.engine.num_kv_blocks * config.cache.block_size
        images = None if config.multimodal is None else ImageProcessor(config.model_path, config.multimodal)
        self.input_processor = InputProcessor(self.tokenizer, config.model_config.vocab_size, self.max_model_len,
                                              config.model_config.eos_token_ids, images, config.lora is not None,
                                              check_max_tokens=False)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._checked_adapters: dict[tuple[int, str], str] = {}  # (lora_int_id, lora_path) -> weights digest

    # ---- generate, top to bottom -------------------------------------------------------------------
    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """The final output of each prompt, in order. ``lora_request``: one adapter for every prompt, or a list
        with one (or None) per prompt."""
        prompts, params = prompts_and_params(prompts, sampling_params)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        groups = [self._make_requests(p, sp, lora_request=lora)  # all checked before any is added
                  for p, sp, lora in zip(prompts, params, loras)]
        return self._run(prompts, groups, use_tqdm)

    def _make_requests(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                       ) -> tuple[str, ParentRequest | None, list[Request]]:
        """The engine requests of one prompt (``InputProcessor``: one, or a parent's ``n`` children), as the core
        takes them in: ``(the caller's id, the parent if n > 1, requests)``."""
        if self.config.runner == "pooling":
            raise ValueError(NOT_GENERATING.format(api="LLM.generate / LLM.chat"))
        self.engine.check_admission()  # asleep (weight_sync/): a clear error, never a hang
        if request_id is None:
            request_id = str(next(self._ids))
            while self.output_processor.has_request(request_id):  # a caller took this one by hand
                request_id = str(next(self._ids))
        parent, requests = self.input_processor.process_inputs(request_id, prompt, params, priority=priority,
                                                               cache_salt=cache_salt, lora_request=lora_request)
        if lora_request is not None:  # a LoRARequest, with adapters on: process_inputs checked both
            checked = self.check_adapter(lora_request)
            for request in requests:
                request.lora_request = checked
        taken = [r.request_id for r in requests if self.output_processor.has_request(r.request_id)]
        if taken and parent is not None:
            raise ValueError(f"request_id: the child ids of {request_id!r} ({', '.join(taken)}) are already in use")
        return request_id, parent, [self.engine.preprocess_add_request(r) for r in requests]

    def _run(self, prompts: list[PromptType], groups: list[tuple[str, ParentRequest | None, list[Request]]],
             use_tqdm: bool) -> list[RequestOutput]:
        """Add every prompt's requests, step until all have finished, and return their final outputs in order;
        on an error (or Ctrl-C) the unfinished ones are aborted, their KV given back."""
        results: dict[str, RequestOutput] = {}
        bar = progress_bar(len(groups), use_tqdm)
        try:
            for prompt, (_, parent, requests) in zip(prompts, groups):
                add_to_engine(self.engine, self.output_processor, prompt, parent, requests, final_only=True)
            step_until_finished(self.step, [request_id for request_id, _, _ in groups], results, bar)
        except BaseException:
            self.abort([request_id for request_id, _, _ in groups if request_id not in results])
            raise
        finally:
            bar.close()
        return [results[request_id] for request_id, _, _ in groups]

    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every request that changed (one ``generate`` added: once it finished).
        A step that failed raises its cause (the core aborted that step's requests)."""
        try:
            deltas = self.engine.step()  # the scheduler made them: each request's new tokens
        except StepFailed as exc:
            raise exc.cause from None
        processed = self.output_processor.process_outputs(deltas)
        if processed.reqs_to_abort:  # stop strings ended them
            self.engine.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return processed.outputs

    # ---- the rest of the offline API ---------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Add one prompt's requests without waiting (``step`` runs them); its request id."""
        if request_id is not None and self.output_processor.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request_id, parent, requests = self._make_requests(prompt, params or SamplingParams(), request_id,
                                                           priority, cache_salt, lora_request)
        add_to_engine(self.engine, self.output_processor, prompt, parent, requests)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests by the ids ``add_request`` returned (a parallel-sampling parent aborts its children)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine.finish_requests(self.output_processor.abort_requests(ids), RequestStatus.FINISHED_ABORTED)

    def check_adapter(self, lora_request: LoRARequest) -> LoRARequest:
        """An adapter is served only once its directory passed the checks (``lora/adapter.py``), once: a bad one
        fails here, before any request is queued. The weights checked go to every worker (``add_lora``) and
        are the ones served until ``remove_lora``: the files are not read again. Returns ``lora_request``
        with the digest of those weights, which keys its cached blocks."""
        digest = self._checked_adapters.get(lora_request.key)
        if digest is None:
            adapter = load_adapter(lora_request.lora_path, self.model_config, self.config.lora.max_lora_rank)
            self.collective_rpc("add_lora", (lora_request, adapter))
            digest = self._checked_adapters[lora_request.key] = adapter.digest
        return dataclasses.replace(lora_request, weights_digest=digest)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop adapter ``lora_int_id``'s weights from the workers (a later request with it reads its files
        again); whether any were held. Refused while requests are unfinished."""
        self._require_idle("remove_lora")
        self._checked_adapters = {key: digest for key, digest in self._checked_adapters.items()
                                  if key[0] != lora_int_id}
        return any(self.collective_rpc("remove_lora", (lora_int_id,)))

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True, *,
             chat_template: str | None = None, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, lora_request: LoRARequest | None = None):
        """``generate`` on conversations rendered by the chat template (the model's, or ``chat_template``),
        image content parts included; a control-token string inside a message stays text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        render = {"add_generation_prompt": add_generation_prompt, "tools": tools, "chat_template": chat_template,
                  "chat_template_kwargs": chat_template_kwargs}
        return self.generate([{"messages": c, **render} for c in conversations], sampling_params, use_tqdm,
                             lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """``method`` (a worker method's name, or ``fn(worker, ...)``) on every worker; results in rank order.
        ``timeout``: seconds to wait for the ranks, else ``TimeoutError`` (the call itself runs on)."""
        return self._between_steps(lambda: self.engine.utilities.collective_rpc(method, args, kwargs), timeout)

    def _require_idle(self, what: str) -> None:
        """A call that changes what requests run on waits for nothing here (the caller drives the steps), so it
        is refused while requests this ``LLM`` was given are unfinished."""
        unfinished = self.engine.unfinished_request_ids()
        if unfinished:
            raise RuntimeError(f"{what}: {len(unfinished)} request(s) are unfinished; step them to the end or "
                               f"abort them first (no request may run on two sets of weights)")

    # ---- serving while training (weight_sync/, with enable_weight_sync=True) ---------------------------------
    def _weight_sync(self, what: str, idle: bool = True) -> WeightSync:
        if self.engine.weight_sync is None:
            raise ValueError(f"{what}: weight updates and sleep are off; start the engine with enable_weight_sync=True")
        if idle:
            self._require_idle(what)
        return self.engine.weight_sync

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load ``(checkpoint name, tensor)`` pairs into every rank (each takes its shard), reset the prefix
        cache; returns the new weight version."""
        return self._weight_sync("update_weights").update_weights(named_tensors)

    def update_weights_from_path(self, path: str) -> int:
        """Every tensor of a checkpoint directory with the served model's names and shapes."""
        return self._weight_sync("update_weights_from_path").update_weights_from_path(path)

    def update_weights_from_distributed(self, metadata: list[tuple[str, str, list[int]]]) -> int:
        """Receive one broadcast per ``(name, dtype, shape)`` from the trainer's group (join it first:
        ``collective_rpc("init_weight_update_group", ...)``; ``weight_sync/group.py``)."""
        return self._weight_sync("update_weights_from_distributed").update_weights_from_distributed(metadata)

    def reload_weights(self) -> int:
        """The served checkpoint's weights again (after ``sleep(level=2)`` and ``wake_up``)."""
        return self._weight_sync("reload_weights").reload_weights()

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 1), and the weights too (level 2); bytes freed. Requests are refused
        until ``wake_up`` (and, after level 2, a weight update)."""
        return self._weight_sync("sleep").sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self._weight_sync("wake_up", idle=False).wake_up(tags)

    def is_sleeping(self) -> bool:
        return self._weight_sync("is_sleeping", idle=False).is_sleeping()

    @property
    def weight_version(self) -> int:
        return 0 if self.engine.weight_sync is None else self.engine.weight_sync.version

    @staticmethod
    def _between_steps(fn: Callable[[], Any], timeout: float | None) -> Any:
        if timeout is None:
            return fn()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        future = pool.submit(fn)
        pool.shutdown(wait=False)  # on a timeout the caller stops waiting; the ranks run on
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"collective_rpc: the workers did not answer within {timeout} s") from None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.engine.shutdown()


__all__ = ["LLM", "SERVER_ENGINE_ARGS"]
