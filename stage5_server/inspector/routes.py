"""The inspector's routes, added to the app only with ``--enable-inspector``: off, they answer 404 and are
absent from the OpenAPI schema.

- ``GET /inspect``: the page (``static/inspect.html``): the step timeline, the KV pool, the queues,
  TTFT and TPOT, and a chat pane that streams from ``/v1/chat/completions``;
- ``GET /inspect/static/{name}``: its script and stylesheet, shipped in the package (nothing from a CDN);
- ``GET /inspect/events``: server-sent events: ``hello`` (the pools as they are, the group's requests),
  then ``steps`` (records, redacted for the key's trust group, and how many this page missed) and
  ``request`` (one of the group's own requests with its text). A stream ends after a few seconds and the
  page's ``EventSource`` opens the next at once, sending the position it reached (``Last-Event-ID``), so it
  goes on where it was; and a server that shuts down never waits for a page left open.

Every response of the page carries a content-security policy that allows scripts, styles and
connections from this server only: the page renders model output as text (``textContent``), and the
policy is the second wall if that were ever got wrong.

The routes are behind the API key like every route. A browser cannot attach a bearer header to the page
it navigates to, so with the inspector on the key middleware also takes the key as the password of HTTP
Basic authentication (the browser asks for it once), on the routes the page uses (``is_browser_route``)
and only from a same-origin page or the address bar (``Sec-Fetch-Site``): another site cannot make a
visitor's browser use it (``server/auth.py``).

vLLM: none; llama.cpp's ``llama-server`` serves its chat page at ``/`` (``tools/server/webui``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from stage5_server.inspector.hub import InspectorHub

STATIC = {"inspector.js": "text/javascript", "inspector.css": "text/css"}
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
BROWSER_ROUTES = frozenset({("GET", "/inspect"), ("GET", "/inspect/events"), ("GET", "/v1/models"),
                            ("POST", "/v1/chat/completions")})
STREAM_LIFETIME_S = 4.0  # then the page reconnects (Last-Event-ID): a graceful shutdown waits at most this long
RECONNECT_MS = 200
FRAME_INTERVAL_S = 0.05  # at most about 20 events a second: a page that draws slowly gets records in batches


def is_browser_route(method: str, path: str) -> bool:
    """The routes the page calls: where a browser's Basic credentials are taken (``server/auth.py``)."""
    return (method, path) in BROWSER_ROUTES or (method == "GET" and path.startswith("/inspect/static/"))


def static_file(name: str) -> bytes:
    return resources.files("stage5_server.inspector").joinpath("static", name).read_bytes()


def add_inspector_routes(app: FastAPI, engine: Any, trust_group: Callable[[Request], str | None]) -> InspectorHub:
    """Add the routes, and connect a hub to ``engine`` (its step records and finished outputs); return the hub
    (the server tells it who sent each request: ``InspectorHub.track``). ``trust_group``: a request's group."""
    hub = InspectorHub()
    engine.step_record_sink = hub.take
    engine.stat_loggers.append(hub)
    page = static_file("inspect.html")
    files = {name: static_file(name) for name in STATIC}

    @app.get("/inspect", summary="The inspector page: every engine step, the KV pool, and a chat pane")
    async def inspect_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/inspect/static/{name}", include_in_schema=False)
    async def inspect_static(name: str) -> Response:
        if name not in files:
            return Response(status_code=404, headers=PAGE_HEADERS)
        return Response(files[name], media_type=STATIC[name] + "; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/inspect/events", summary="Server-sent events of step records, for the key's trust group")
    async def inspect_events(request: Request) -> StreamingResponse:
        group = trust_group(request)
        since = request.headers.get("last-event-id", "")
        subscriber = hub.subscribe(group or "", asyncio.get_running_loop())
        loop = asyncio.get_running_loop()

        async def events() -> AsyncIterator[str]:
            try:
                yield f"retry: {RECONNECT_MS}\n" + frame("hello", hub.hello(subscriber, int(since) if since.isdigit()
                                                                           else None), subscriber.seq)
                end = loop.time() + STREAM_LIFETIME_S
                while loop.time() < end:
                    try:
                        await asyncio.wait_for(subscriber.event.wait(), end - loop.time())
                    except asyncio.TimeoutError:
                        break
                    for name, data in hub.poll(subscriber):
                        yield frame(name, data, subscriber.seq)
                    await asyncio.sleep(FRAME_INTERVAL_S)
            finally:
                hub.unsubscribe(subscriber)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**PAGE_HEADERS, "X-Accel-Buffering": "no"})

    return hub


def frame(event: str, data: Any, position: int) -> str:
    """One event; its ``id`` is the stream's position, which the page sends back when it reconnects."""
    return f"event: {event}\nid: {position}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
