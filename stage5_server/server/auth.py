"""Who may call the server, and whose prefix cache a request may share.

Authentication is an ASGI middleware around the whole app, so it covers every route, even an
unknown path, except ``/health`` (and ``/metrics`` when public); vLLM checks ``/v1`` and a few
other prefixes. Keys are compared by ``hmac.compare_digest`` over SHA-256 digests (timing reveals
nothing). Each key belongs to a trust group; a request's prefix-cache salt is an HMAC of its group
under a per-server secret, so groups never share cached blocks and no client can compute another
group's salt. A client ``cache_salt`` is refused unless ``trust_client_cache_salt``.

vLLM: ``AuthenticationMiddleware`` in ``vllm/entrypoints/openai/api_server.py``; the salt is
the ``cache_salt`` that ``vllm/v1/core/kv_cache_utils.py`` mixes into the first block's hash.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Mapping

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from stage5_server.server.errors import APIError, error_body, send_json

PUBLIC_GROUP = "public"  # the one trust group of a server run without API keys
TRUST_GROUP_SCOPE_KEY = "stagedserve.trust_group"
RECEIVED_SCOPE_KEY = "stagedserve.received"  # time.monotonic() when the request reached the server
_GROUP_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class APIKeys:
    """API keys, each in a trust group, checked in constant time; a key without a group is a group of its own."""

    def __init__(self, keys: Mapping[str, str | None] | list[str]):
        pairs = list(keys.items()) if isinstance(keys, Mapping) else [(k, None) for k in keys]
        if not pairs:
            raise ValueError("api_keys: empty; pass None to run without authentication")
        self._digests: list[tuple[bytes, str]] = []
        for i, (key, group) in enumerate(pairs, start=1):
            if not isinstance(key, str) or not key or any(c.isspace() for c in key):
                raise ValueError(f"api_keys: key #{i} must be a non-empty string without whitespace")
            if group is None:
                group = f"key#{i}"
            elif not isinstance(group, str) or not _GROUP_NAME.match(group):
                raise ValueError(f"api_keys: group of key #{i} must match {_GROUP_NAME.pattern}, got {group!r}")
            self._digests.append((hashlib.sha256(key.encode()).digest(), group))
        if len({d for d, _ in self._digests}) != len(self._digests):
            raise ValueError("api_keys: the same key is listed twice")

    @property
    def groups(self) -> list[str]:
        return sorted({g for _, g in self._digests})

    def __len__(self) -> int:
        return len(self._digests)

    def authenticate(self, token: str | None) -> str | None:
        """The trust group of ``token``, or None. Compares against every key, always."""
        if token is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        group = None
        for key_digest, key_group in self._digests:
            if hmac.compare_digest(digest, key_digest):
                group = key_group
        return group


def trust_group(request: Request) -> str:
    """The trust group of the request's key (set by ``APIKeyMiddleware``; only a public path has none)."""
    group = request.scope.get(TRUST_GROUP_SCOPE_KEY)
    if group is None:
        raise APIError(401, "An API key is required.", code="invalid_api_key")
    return group


class CacheSalter:
    """Prefix-cache salts: ``HMAC(secret, group [, client salt])``, unguessable without the secret."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def salt(self, group: str, client_salt: str | None = None) -> str:
        message = b"stagedserve-cache-salt\x00" + group.encode() + b"\x00"
        if client_salt is not None:
            message += b"\x01" + client_salt.encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def _route_path(scope: Scope) -> str:
    """The path the router matches (``scope["path"]`` less ``root_path``), as Starlette computes it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root):]
    return path


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class APIKeyMiddleware:
    """Every HTTP and WebSocket request needs a valid key, except ``public_paths``. It runs before
    routing, so no route escapes it, and an unknown path answers 401 (not 404) without a key."""

    def __init__(self, app: ASGIApp, keys: APIKeys | None, public_paths: frozenset[str]):
        self.app = app
        self.keys = keys
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope[RECEIVED_SCOPE_KEY] = time.monotonic()  # the outermost layer: the start of the request's timeline
        group = PUBLIC_GROUP if self.keys is None else self.keys.authenticate(_bearer_token(scope))
        if group is None and _route_path(scope) not in self.public_paths:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await send_json(send, 401, error_body(
                "Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error", None, "invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        scope[TRUST_GROUP_SCOPE_KEY] = group
        await self.app(scope, receive, send)
