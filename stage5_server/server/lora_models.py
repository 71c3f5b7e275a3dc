"""The models a request's ``model`` field may name: the base model, and each LoRA adapter by its name.

``ServedModels`` maps a name to the ``LoRARequest`` the engine runs it with (None for the base
model) and answers an unknown name with OpenAI's 404 ``model_not_found``. Adapters come from
``--lora-modules name=path`` at start, or, with ``--enable-lora`` and the runtime-update switch
(vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, or ``STAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING``),
from ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (behind the API key, as every
route but ``/health``).

**Whose adapter.** An adapter listed at start-up serves every trust group. An adapter loaded at run
time belongs to the trust group of the key that loaded it (``auth.py``): for any other group it does
not exist, on every route that takes a model name (a 404, the same as for a name never loaded), in
``/v1/models`` and on the unload route. Each group has its own names: two groups may each load an
adapter called ``support``, and each gets its own; a name listed at start-up is taken for all. With
more than one trust group, no group may unload an adapter listed at start-up (every group uses it).
No response says where an adapter lies on the server's disk: a card's ``root`` is its name.

**What a load checks.** A load reads and checks the whole adapter first (``lora/adapter.py``: its rank
against ``--max-lora-rank``, its target modules and shapes against the model, every tensor floating
point and finite) and lists it only if every check passed: a failed load is a 400 and leaves nothing
behind. A name is a model id (1 to 256 printable characters, no whitespace, not the base model's nor
a listed adapter's); with ``STAGEDSERVE_LORA_ADAPTER_ROOT`` set, a runtime load reads only from under
that directory (``..``, absolute paths and symbolic links resolved first), so a key holder cannot make
the server read, or probe for, files elsewhere. Each load gets a new ``lora_int_id`` and carries the
digest of the weights it checked (``weights_digest``), which the prefix cache keys the adapter's
blocks by: an adapter loaded again with other weights, under the same name and path, never meets the
K/V its old weights computed.

**Where the weights go.** An adapter with requests still in flight is not unloaded: the route refuses
with a 400 saying so (its requests keep their ``LoRARequest`` and run to the end). The weights a load
checked are the weights served: they go to every worker of every engine core
(``collective_rpc("add_lora")``, before a runtime load is listed; at the app's start-up for
``--lora-modules``), so the files are read once, and deleting or changing them afterwards changes
nothing; one the workers do not take at start-up is not listed. An unload drops the workers' copies
(``remove_lora``). Several API servers over the same engine cores (``--api-server-count``) number
their loads apart, so one's unload never drops another's copy.

vLLM: ``OpenAIServingModels`` in ``vllm/entrypoints/openai/serving_models.py`` (``load_lora_adapter``,
``unload_lora_adapter``, ``show_available_models``), where every adapter serves every key and its card's
``root`` is its path on the server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from shared.config import ModelConfig
from stage5_server.config.model import read_model_config
from stage5_server.lora import LoRALoadError, LoRAModel, LoRARequest, load_adapter
from stage5_server.server.auth import trust_group
from stage5_server.server.errors import APIError

logger = logging.getLogger("stagedserve")

RUNTIME_UPDATE_SWITCHES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "STAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING")
RUNTIME_ROOT_VARIABLE = "STAGEDSERVE_LORA_ADAPTER_ROOT"  # runtime loads only from under this directory
MAX_LORA_NAME_CHARS = 256


def check_lora_name(name: str, base_name: str) -> None:
    """An adapter's name is a model id: 1 to 256 printable characters, no whitespace, not the base model's."""
    if not name or name == base_name or len(name) > MAX_LORA_NAME_CHARS or not name.isprintable() \
            or any(c.isspace() for c in name):
        shown = name if len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)"
        raise APIError(400, f"lora_name: {shown!r} cannot name an adapter: a name is 1 to {MAX_LORA_NAME_CHARS} "
                       "printable characters without whitespace, other than the base model's", param="lora_name")


def runtime_adapter_path(path: str, environ=os.environ) -> str:
    """Where a runtime load may read: with ``STAGEDSERVE_LORA_ADAPTER_ROOT`` set, ``path`` (relative to that
    root, or absolute) must resolve, symbolic links followed, to a directory inside it; a 400 otherwise."""
    root = environ.get(RUNTIME_ROOT_VARIABLE, "").strip()
    if not root:
        return path
    try:
        root = os.path.realpath(root)
        resolved = os.path.realpath(os.path.join(root, path))
        inside = os.path.commonpath([root, resolved]) == root
    except ValueError:  # a NUL byte
        inside = False
    if not inside:
        raise APIError(400, f"lora_path: {path!r} is outside the directory this server loads adapters from "
                       f"({RUNTIME_ROOT_VARIABLE})", param="lora_path")
    return resolved


def runtime_lora_updating_allowed(environ=os.environ) -> bool:
    return any(environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATE_SWITCHES)


def parse_lora_modules(values: Sequence[str]) -> list[tuple[str, str]]:
    """``--lora-modules name=path ...`` as ``(name, path)`` pairs (a ValueError names a bad one)."""
    pairs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected name=path, got {value!r}")
        pairs.append((name.strip(), path.strip()))
    return pairs


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None


Owner = str | None  # the trust group an adapter belongs to; None: listed at start-up, every group's


class ServedModels:
    def __init__(self, base_name: str, engine: Any):
        self.base_name = base_name
        self.engine = engine
        args = getattr(engine, "engine_args", {})
        self.enabled = bool(args.get("enable_lora"))
        self.max_lora_rank = args.get("max_lora_rank", 16)
        self.num_groups = 1  # trust groups of the server's keys (create_app sets it)
        self.adapters: dict[tuple[Owner, str], LoRARequest] = {}  # (owner, name) -> the adapter
        self.in_flight: dict[LoRARequest, list[str]] = {}  # adapter -> request ids sent with it
        self.sending: Counter[LoRARequest] = Counter()  # adapter -> requests on their way to the engine
        self.unsent: dict[str, LoRAModel] = {}  # listed at start-up, weights not yet with the workers
        # API server i of A numbers its loads i+1, i+1+A, ...: no two servers over the same engine cores give
        # one id to two adapters, so an unload (which drops the workers' copies by id) drops only its own.
        self._ids = itertools.count(engine.client_index + 1, engine.client_count)
        self._model_config: ModelConfig | None = None

    # ---- what a request's ``model`` means ---------------------------------------------------------
    def find(self, name: str, group: Owner) -> tuple[Owner, str] | None:
        """Where adapter ``name`` is listed for ``group``: its own, else one listed at start-up."""
        for key in ((group, name), (None, name)):
            if key in self.adapters:
                return key
        return None

    def resolve(self, model: str | None, group: Owner) -> LoRARequest | None:
        """The adapter ``model`` names for ``group``; None for the base model (or no name); 404 for anything
        else, another group's adapters included."""
        if model is None or model == self.base_name:
            return None
        key = self.find(model, group)
        if key is None:
            raise model_not_found(model)
        return self.adapters[key]

    @contextmanager
    def send(self, lora: LoRARequest | None) -> Iterator[None]:
        """Around handing a request's engine requests to the engine, then ``track``: an unload meanwhile is
        refused as busy, and an adapter unloaded since the request was admitted is a 404 (its weights may
        have left the workers)."""
        if lora is None:
            yield
            return
        if lora not in self.adapters.values():
            raise model_not_found(lora.lora_name)
        self.sending[lora] += 1
        try:
            yield
        finally:
            self.sending[lora] -= 1
            if not self.sending[lora]:
                del self.sending[lora]

    def track(self, lora: LoRARequest | None, request_ids: list[str]) -> None:
        if lora is not None:
            self.in_flight.setdefault(lora, []).extend(request_ids)

    def busy(self, lora: LoRARequest) -> int:
        """How many requests with adapter ``lora`` are in flight or on their way to the engine."""
        running = [rid for rid in self.in_flight.get(lora, []) if self.engine.is_in_flight(rid)]
        self.in_flight[lora] = running
        return len(running) + self.sending[lora]

    # ---- load and unload ------------------------------------------------------------------------
    def check(self, name: str, path: str, owner: Owner) -> tuple[LoRARequest, LoRAModel]:
        """Read and check the adapter at ``path`` whole for the name ``name`` of ``owner`` (a 400 otherwise); its
        request and weights, nothing listed yet."""
        if not self.enabled:
            raise APIError(400, "LoRA adapters are not served: start the server with --enable-lora",
                           param="lora_name")
        check_lora_name(name, self.base_name)
        self._check_free(name, owner)
        if self._model_config is None:
            self._model_config = read_model_config(self.engine.model_path)[0]  # the decoder's shape
        try:
            adapter = load_adapter(path, self._model_config, self.max_lora_rank)
        except LoRALoadError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return LoRARequest(name, next(self._ids), os.path.abspath(path), adapter.digest), adapter

    def _check_free(self, name: str, owner: Owner) -> None:
        """A name is free for ``owner`` unless ``owner`` or the start-up list has it (another group's is no
        matter: saying so would tell one group what another loaded)."""
        if self.find(name, owner) is not None:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                           code="lora_already_loaded")

    def load(self, name: str, path: str) -> LoRARequest:
        """At start-up: check the adapter and list it for every group; its weights go to the workers with
        ``send_unsent``."""
        lora, adapter = self.check(name, path, None)
        self.adapters[(None, name)] = lora
        self.unsent[name] = adapter
        return lora

    async def add(self, name: str, path: str, owner: str) -> LoRARequest:
        """At run time, for trust group ``owner``: check the adapter (off the loop), hand its weights to every
        worker, then list it for that group."""
        lora, adapter = await asyncio.to_thread(self.check, name, path, owner)
        await self._hand_over(lora, adapter)
        if self.find(name, owner) is not None:  # loaded by another call meanwhile
            await self._take_back(lora)
            self._check_free(name, owner)
        self.adapters[(owner, name)] = lora
        return lora

    async def send_unsent(self) -> None:
        """Hand the start-up adapters' weights to the workers (the app's start). One the workers did not take
        is unlisted (its requests are 404s), never served from files that may have changed since the check."""
        for name, adapter in list(self.unsent.items()):
            del self.unsent[name]
            try:
                await self._hand_over(self.adapters[(None, name)], adapter)
            except Exception as exc:  # the server starts all the same
                logger.error("LoRA adapter %r is not served: the workers did not take its weights: %s", name, exc)
                await self._take_back(self.adapters.pop((None, name)))

    async def _hand_over(self, lora: LoRARequest, adapter: LoRAModel) -> None:
        try:
            await self.engine.collective_rpc("add_lora", (lora, adapter))
        except Exception as exc:
            if self.engine.is_running:
                raise
            raise APIError(503, f"The engine is not running ({exc}).", code="engine_unavailable") from None

    async def _take_back(self, lora: LoRARequest) -> None:
        try:
            await self.engine.collective_rpc("remove_lora", (lora.lora_int_id,))
        except Exception as exc:  # the engine stopped: its workers and their copies are gone too
            logger.warning("LoRA adapter %r: the workers' copies were not dropped: %s", lora.lora_name, exc)

    def unload(self, name: str, group: Owner) -> LoRARequest:
        """Unlist adapter ``name`` as ``group`` sees it: 404 unless it is the group's own or listed at start-up;
        400 for a start-up adapter that other groups use too, or one with requests in flight."""
        key = self.find(name, group)
        if key is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        if key[0] is None and self.num_groups > 1:
            raise APIError(400, f"The lora adapter '{name}' was listed at start-up and serves every trust group; "
                           "it is not unloaded through the API", param="lora_name", code="lora_shared")
        lora = self.adapters[key]
        busy = self.busy(lora)
        if busy:
            raise APIError(400, f"The lora adapter '{name}' has {busy} request(s) in flight; unload it once they "
                           f"finish", param="lora_name", code="lora_in_use")
        self.in_flight.pop(lora, None)
        if key[0] is None:
            self.unsent.pop(name, None)
        return self.adapters.pop(key)

    async def remove(self, name: str, group: Owner) -> None:
        """Unlist adapter ``name`` of ``group`` and drop the workers' copies of its weights."""
        await self._take_back(self.unload(name, group))

    def cards(self, base_card: dict[str, Any], group: Owner) -> list[dict[str, Any]]:
        """``/v1/models``' entries for ``group``: the base model, then each adapter it may use, with the base model
        as ``parent`` and its own name as ``root`` (where it lies on disk is the server's business)."""
        usable = [lora for (owner, _), lora in self.adapters.items() if owner is None or owner == group]
        return [base_card, *({**base_card, "id": lora.lora_name, "root": lora.lora_name, "parent": self.base_name,
                              "permission": [{**p, "id": f"modelperm-{lora.lora_name}"}
                                             for p in base_card.get("permission", [])]}
                             for lora in usable)]


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def add_routes(app: FastAPI, models: ServedModels) -> None:
    """The runtime routes, only with ``--enable-lora`` and the runtime-update switch (as in vLLM)."""
    if not (models.enabled and runtime_lora_updating_allowed()):
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
        await models.add(body.lora_name, runtime_adapter_path(body.lora_path), trust_group(request))
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
        await models.remove(body.lora_name, trust_group(request))
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

