"""The proxy in front of a prefill instance and a decode instance: ``stagedserve disagg-proxy``.

Each generation request goes twice: first to the prefill instance with ``max_tokens`` 1 and no stream (it
computes the prompt's K/V and, as a ``kv_producer``, sends every full block to the decode instance before
it answers), then, unchanged, to the decode instance (a ``kv_consumer``), which finds those blocks, computes
at most the last partial block and generates; its answer, streamed or not, goes back to the client as it
comes. The client sees one OpenAI-compatible server.

- A request the prefill instance refuses (a 4xx) is answered with that refusal: the decode instance would
  give the same one.
- A prefill instance that cannot be reached is skipped: the decode instance prefills the request itself
  (same tokens, slower), and the proxy logs it.
- A decode instance that cannot be reached is a 502 in OpenAI's error shape; one that fails mid-stream ends
  the stream with an error event. A client that goes away closes the decode instance's stream, which aborts
  the request there.
- Every other route (``/v1/models``, ``/tokenize``, ``/v1/responses``, ...) goes to the decode instance alone.

The proxy listens on loopback unless ``--host`` names another address, and forwards the client's
``Authorization`` header to both instances.

vLLM: ``examples/online_serving/disaggregated_serving/disagg_proxy_demo.py`` and the P2P NCCL example's
``disagg_proxy_p2p_nccl_xpyd.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from stage5_server.arg_types import port

logger = logging.getLogger("stagedserve")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id", "accept")
TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)


def prefill_body(body: dict) -> dict:
    """``body`` as the prefill instance gets it: one token, one choice, no stream."""
    body = {key: value for key, value in body.items()
            if key not in ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n", "best_of")}
    body["max_tokens"] = 1
    return body


def gateway_error(message: str, status: int = 502) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": status}}


def create_proxy_app(prefill_url: str, decode_url: str) -> FastAPI:
    client = httpx.AsyncClient(timeout=TIMEOUT)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="stagedserve disaggregated prefill/decode proxy", lifespan=lifespan)
    app.state.prefill_skipped = 0  # requests the decode instance prefilled itself (prefill unreachable)

    def headers_of(request: Request) -> dict[str, str]:
        return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}

    async def forward(request: Request, path: str, body: bytes) -> Response:
        """``body`` to the decode instance; its answer back as it comes (a stream stays a stream)."""
        try:
            upstream = await client.send(client.build_request(request.method, decode_url + path, content=body,
                                                              headers=headers_of(request),
                                                              params=request.query_params), stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse(gateway_error(f"the decode instance at {decode_url} is unreachable: {exc}"), 502)
        media_type = upstream.headers.get("content-type", "application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # the decode instance failed mid-answer
                error = gateway_error(f"the decode instance at {decode_url} failed mid-stream: {exc}")
                if media_type.startswith("text/event-stream"):
                    yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type=media_type)

    async def generate(request: Request) -> Response:
        path, raw = request.url.path, await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None  # not JSON: the decode instance gives the client its error
        if isinstance(body, dict):
            try:
                prefill = await client.post(prefill_url + path, json=prefill_body(body),
                                            headers=headers_of(request))
            except httpx.HTTPError as exc:
                app.state.prefill_skipped += 1
                logger.warning("disagg-proxy: prefill instance %s unreachable (%s): the decode instance "
                               "prefills this request", prefill_url, exc)
            else:
                if 400 <= prefill.status_code < 500:  # a refusal the decode instance would repeat
                    return Response(prefill.content, prefill.status_code,
                                    media_type=prefill.headers.get("content-type"))
        return await forward(request, path, raw)

    for route in GENERATION_ROUTES:
        app.add_api_route(route, generate, methods=["POST"], include_in_schema=False)

    @app.get("/health")
    async def health() -> Response:
        states = {}
        for name, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                states[name] = (await client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                states[name] = False
        return JSONResponse(states, 200 if states["decode"] else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def other(path: str, request: Request) -> Response:
        return await forward(request, "/" + path, await request.body())

    return app


def add_disagg_proxy_subcommand(subparsers) -> None:
    p = subparsers.add_parser("disagg-proxy", help="one OpenAI endpoint in front of a prefill and a decode instance",
                              description="Send each generation request to the prefill instance with max_tokens 1, "
                                          "then to the decode instance (docs/kv-transfer.md).")
    p.add_argument("--prefill", required=True, metavar="URL", help="the kv_producer server, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL", help="the kv_consumer server, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    p.add_argument("--port", type=port, default=8000)
    p.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = create_proxy_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
