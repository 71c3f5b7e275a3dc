"""The development routes an RL trainer drives the server with: sleep, wake, weight updates, RPC
(the engine's side: ``weight_sync/``, a member of the front end when the engine runs with weight sync,
which ``--enable-dev-routes`` turns on; and the core's own utilities, ``core/utilities.py``).

They exist only with ``--enable-dev-routes`` (``ServerConfig.enable_dev_routes``); off (the default)
each is a 404 and none is in the schema. On, each sits behind the API key like every other route.

    POST /sleep?level=1|2      -> {"sleeping": true, "level", "freed_bytes"}   (after the requests in flight)
    POST /wake_up[?tags=...]   -> {"sleeping": false}   (level 2: then POST /update_weights before serving)
    GET  /is_sleeping          -> {"is_sleeping": bool}
    POST /reset_prefix_cache   -> {"reset": bool}        (false while requests hold blocks)
    POST /collective_rpc       {"method", "args", "kwargs", "timeout"} -> {"results": [...]}, one per worker
    POST /update_weights       {"path"} | {"reload": true} | {"tensors": [{"name", "dtype", "shape"}]}
                               -> {"weight_version"}     (``tensors``: broadcast by the trainer's group)

Weights change through ``/update_weights`` only: it drains, resets the prefix cache and counts a version.
``/collective_rpc`` refuses the worker's weight methods, ``shutdown`` and the core's own (``weight_sync/core.py``),
and the adapter methods (the LoRA routes load and unload adapters per trust group); joining a trainer's group
(``init_weight_update_group``) returns at once and the join runs beside the engine's steps. A checkpoint path
the server cannot read is one 400 whatever the reason, so the route tells nobody which paths exist.

While the engine sleeps, a generation request is a 503 naming the cause (``engine_unavailable``).

vLLM: ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``, ``/collective_rpc`` in
``vllm/entrypoints/openai/api_server.py`` (``if envs.VLLM_SERVER_DEV_MODE``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from stage5_server.errors import EngineSleepingError
from stage5_server.server.errors import APIError, validation_error

if TYPE_CHECKING:
    from stage5_server.engine.frontend import AsyncEngine


class CollectiveRPCBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[int]


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    reload: bool = False
    tensors: list[TensorSpec] | None = None


async def parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(json.loads(await request.body() or b"{}"))
    except json.JSONDecodeError as exc:
        raise APIError(400, f"The body is not valid JSON: {exc}") from None
    except ValidationError as exc:
        raise validation_error(exc) from None


# Worker methods the route does not pass on by name: adapters are loaded and unloaded, each for its trust group,
# through /v1/load_lora_adapter and /v1/unload_lora_adapter (server/lora_models.py).
NOT_BY_RPC = {"add_lora": "POST /v1/load_lora_adapter", "remove_lora": "POST /v1/unload_lora_adapter"}


def to_api_error(exc: Exception, param: str | None = None) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param)
    if isinstance(exc, EngineSleepingError):
        return APIError(503, str(exc), code="engine_sleeping")
    if isinstance(exc, TimeoutError):
        return APIError(504, str(exc), code="timeout")
    return APIError(500, str(exc), code="engine_error")


def plain(value: Any) -> Any:
    """A worker's result as JSON can carry it (anything else as its repr)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def add_dev_routes(app: FastAPI, engine: AsyncEngine) -> None:
    async def run(coro, param: str | None = None) -> Any:
        try:
            return await coro
        except Exception as exc:
            raise to_api_error(exc, param) from None

    def weight_sync() -> Any:
        if engine.weight_sync is None:
            raise APIError(400, "this engine runs without weight updates and sleep; start it with "
                           "enable_weight_sync=True (--enable-weight-sync)")
        return engine.weight_sync

    @app.post("/sleep", summary="Free the KV cache (level 1) and the weights (level 2); requests are refused")
    async def sleep(level: int = 1) -> dict:
        if level not in (1, 2):
            raise APIError(400, f"level: must be 1 or 2, got {level}", param="level")
        freed = await run(weight_sync().sleep(level))
        return {"sleeping": True, "level": level, "freed_bytes": freed}

    @app.post("/wake_up", summary="Allocate the KV cache again (after level 2, update the weights next)")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict:
        await run(weight_sync().wake_up(tags))
        return {"sleeping": False}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": await run(weight_sync().is_sleeping())}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"reset": await run(engine.reset_prefix_cache())}

    @app.post("/collective_rpc", summary="A worker method on every worker, by name; the results in rank order")
    async def collective_rpc(request: Request) -> dict:
        body = await parse(request, CollectiveRPCBody)
        if body.method in NOT_BY_RPC:
            raise APIError(400, f"collective_rpc: {body.method!r} is not called by name here; use "
                           f"{NOT_BY_RPC[body.method]}", param="method")
        results = await run(engine.collective_rpc(body.method, tuple(body.args), body.kwargs, body.timeout))
        return {"results": [plain(r) for r in results]}

    @app.post("/update_weights", summary="New weights from a checkpoint directory, the served one, or a broadcast")
    async def update_weights(request: Request) -> dict:
        body = await parse(request, UpdateWeightsBody)
        sources = [body.path is not None, body.reload, body.tensors is not None]
        if sum(sources) != 1:
            raise APIError(400, "update_weights: give exactly one of path, reload, tensors")
        if body.path is not None:
            version = await run(weight_sync().update_weights_from_path(body.path), param="path")
        elif body.reload:
            version = await run(weight_sync().reload_weights())
        else:
            metadata = [(t.name, t.dtype, t.shape) for t in body.tensors]
            version = await run(weight_sync().update_weights_from_distributed(metadata))
        return {"weight_version": version}
