"""The proxy in front of a prefill instance and a decode instance: ``stagedserve disagg-proxy``.

Each generation request goes twice: first to the prefill instance with ``max_tokens`` 1 and no stream (it
computes the prompt's K/V and, as a ``kv_producer``, sends every full block to the decode instance before
it answers), then, unchanged, to the decode instance (a ``kv_consumer``), which finds those blocks, computes
at most the last partial block and generates; its answer, streamed or not, goes back to the client as it
comes. The client sees one OpenAI-compatible server.

- Each generation request gets a fresh random transfer id, sent to both instances as ``X-KV-Transfer-Id``:
  the producer sends the request's blocks under it, and the consumer gives them to this request only
  (``p2p.py``).
- A request the prefill instance refuses (a 4xx) is answered with that refusal: the decode instance would
  give the same one.
- A prefill instance that cannot be reached (the connection refused, or not accepted within
  ``CONNECT_TIMEOUT_S``) is skipped: the decode instance prefills the request itself (same tokens,
  slower), and the proxy logs it. One that accepts the connection but does not answer within
  ``--prefill-timeout`` (a frozen process: the kernel still accepts for it) is a 504 in OpenAI's error
  shape, naming the instance and the deadline.
- A decode instance that cannot be reached is a 502; one that does not start answering, or stops between
  two chunks, for ``--decode-timeout`` is a 504 (mid-stream: an error event ends the stream); one that fails
  mid-stream ends the stream with an error event. A client that goes away closes the decode instance's
  stream, which aborts the request there.
- ``/health`` asks both instances at once, each with a two-second deadline, and says what it found for each:
  ``ok``, ``unreachable``, ``not answering`` or ``unhealthy``. It is 200 only while requests can be served:
  the decode instance ``ok``, the prefill instance ``ok`` or ``unreachable`` (skipped); a frozen prefill
  instance, whose requests would wait out their deadline, makes it 503.
- Every other route (``/v1/models``, ``/tokenize``, ``/v1/responses``, ...) goes to the decode instance alone.

The proxy listens on loopback unless ``--host`` names another address, and forwards the client's
``Authorization`` header to both instances.

vLLM: ``examples/online_serving/disaggregated_serving/disagg_proxy_demo.py`` and the P2P NCCL example's
``disagg_proxy_p2p_nccl_xpyd.py`` (an ``aiohttp`` client with a six-hour total timeout and no read
deadline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from stage5_server.arg_types import port

logger = logging.getLogger("stagedserve")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id", "accept")
KV_TRANSFER_HEADER = "X-KV-Transfer-Id"  # the servers read it (server/serving.py)
CONNECT_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 2.0
DEFAULT_PREFILL_TIMEOUT_S = 60.0  # the prefill instance's whole answer (one token)
DEFAULT_DECODE_TIMEOUT_S = 300.0  # the decode instance's first byte, and each gap between two chunks after it


def deadlines(read_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=read_s, write=WRITE_TIMEOUT_S, pool=CONNECT_TIMEOUT_S)


def prefill_body(body: dict) -> dict:
    """``body`` as the prefill instance gets it: one token, one choice, no stream."""
    body = {key: value for key, value in body.items()
            if key not in ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n", "best_of")}
    body["max_tokens"] = 1
    return body


def gateway_error(message: str, status: int = 502) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": status}}


def unreachable(exc: httpx.HTTPError) -> bool:
    """The instance never took the request: refused, or no connection within the connect deadline."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


async def health_of(client: httpx.AsyncClient, url: str) -> str:
    try:
        response = await client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return "unreachable" if unreachable(exc) else "not answering"
    return "ok" if response.status_code == 200 else "unhealthy"


def create_proxy_app(prefill_url: str, decode_url: str, prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
                     decode_timeout_s: float = DEFAULT_DECODE_TIMEOUT_S) -> FastAPI:
    client = httpx.AsyncClient(timeout=deadlines(decode_timeout_s))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="stagedserve disaggregated prefill/decode proxy", lifespan=lifespan)
    app.state.prefill_skipped = 0  # requests the decode instance prefilled itself (prefill unreachable)

    def headers_of(request: Request, transfer_id: str | None = None) -> dict[str, str]:
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        return {**headers, KV_TRANSFER_HEADER: transfer_id} if transfer_id else headers

    async def forward(request: Request, path: str, body: bytes, transfer_id: str | None = None) -> Response:
        """``body`` to the decode instance; its answer back as it comes (a stream stays a stream)."""
        try:
            upstream = await client.send(client.build_request(request.method, decode_url + path, content=body,
                                                              headers=headers_of(request, transfer_id),
                                                              params=request.query_params), stream=True)
        except httpx.TimeoutException:
            return JSONResponse(gateway_error(f"the decode instance at {decode_url} did not answer within "
                                              f"{decode_timeout_s:g} s", 504), 504)
        except httpx.HTTPError as exc:
            return JSONResponse(gateway_error(f"the decode instance at {decode_url} is unreachable: {exc}"), 502)
        media_type = upstream.headers.get("content-type", "application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # the decode instance failed, or went silent, mid-answer
                timed_out = isinstance(exc, httpx.TimeoutException)
                why = f"sent nothing for {decode_timeout_s:g} s" if timed_out else f"failed mid-stream: {exc}"
                logger.warning("disagg-proxy: the decode instance %s %s", decode_url, why)
                if media_type.startswith("text/event-stream"):
                    error = gateway_error(f"the decode instance at {decode_url} {why}", 504 if timed_out else 502)
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
        transfer_id = None
        if isinstance(body, dict):
            transfer_id = secrets.token_urlsafe(24)  # 32 characters, random: this request's blocks only
            try:
                prefill = await client.post(prefill_url + path, json=prefill_body(body),
                                            headers=headers_of(request, transfer_id),
                                            timeout=deadlines(prefill_timeout_s))
            except httpx.HTTPError as exc:
                if isinstance(exc, httpx.TimeoutException) and not unreachable(exc):  # took it, then went silent
                    logger.warning("disagg-proxy: prefill instance %s did not answer within %g s", prefill_url,
                                   prefill_timeout_s)
                    return JSONResponse(gateway_error(f"the prefill instance at {prefill_url} did not answer within "
                                                      f"{prefill_timeout_s:g} s", 504), 504)
                app.state.prefill_skipped += 1
                transfer_id = None  # nothing was sent under it
                logger.warning("disagg-proxy: prefill instance %s unreachable (%s): the decode instance "
                               "prefills this request", prefill_url, exc)
            else:
                if 400 <= prefill.status_code < 500:  # a refusal the decode instance would repeat
                    return Response(prefill.content, prefill.status_code,
                                    media_type=prefill.headers.get("content-type"))
        return await forward(request, path, raw, transfer_id)

    for route in GENERATION_ROUTES:
        app.add_api_route(route, generate, methods=["POST"], include_in_schema=False)

    @app.get("/health")
    async def health() -> Response:
        prefill, decode = await asyncio.gather(health_of(client, prefill_url), health_of(client, decode_url))
        serving = decode == "ok" and prefill in ("ok", "unreachable")  # an unreachable prefill is skipped
        return JSONResponse({"prefill": prefill, "decode": decode}, 200 if serving else 503)

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
    p.add_argument("--prefill-timeout", type=positive_seconds, default=DEFAULT_PREFILL_TIMEOUT_S, metavar="S",
                   help="seconds the prefill instance has to answer (then a 504)")
    p.add_argument("--decode-timeout", type=positive_seconds, default=DEFAULT_DECODE_TIMEOUT_S, metavar="S",
                   help="seconds the decode instance may be silent, before its first byte or between two chunks")
    p.set_defaults(func=run_proxy)


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number of seconds, got {value!r}")
    return seconds


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    app = create_proxy_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.prefill_timeout,
                           args.decode_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
