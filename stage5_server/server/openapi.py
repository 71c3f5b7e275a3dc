"""The OpenAPI schema, corrected to what the server really answers.

FastAPI documents its own 422 validation body; this server answers 400 with an OpenAI error
object, 401, 404, 413, and 500/503 from the engine. The schema says so, so that a client
generator or the API fuzzer (``tests/reliability/test_api_fuzz.py``) holds the server to it.
A request body of a route that ignores fields it does not define (``request_fields.py``) allows
additional properties, unless the server was started with ``--strict-request-fields``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from stage5_server.server.request_fields import LENIENT_ROUTES

_ERROR_SCHEMA = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
}


_ENGINE_PATHS = frozenset({"/health", "/v1/completions", "/v1/chat/completions"})


def openapi_with_openai_errors(app: FastAPI, needs_key: bool) -> dict[str, Any]:
    """FastAPI's schema, corrected: bad input is a 400 OpenAI error object (not FastAPI's 422), a bad key a 401."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for fastapi_own in ("HTTPValidationError", "ValidationError"):
        components.pop(fastapi_own, None)
    components["ErrorResponse"] = _ERROR_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    public = app.state.public_paths
    lenient = not app.state.server_config.strict_request_fields
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            has_body = "requestBody" in operation
            if has_body and lenient and path in LENIENT_ROUTES:
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                components.get(body.get("$ref", "").rpartition("/")[2], {}).pop("additionalProperties", None)
            if responses.pop("422", None) is not None or has_body:
                responses["400"] = {"description": "Invalid request", **error}
            if needs_key and path not in public:
                responses["401"] = {"description": "Missing or invalid API key", **error}
            if has_body or "{model}" in path:
                responses["404"] = {"description": "No such model", **error}
            if has_body:
                responses["413"] = {"description": "Request body too large", **error}
            if path in _ENGINE_PATHS:
                responses["500"] = {"description": "The engine failed while running the request", **error}
                responses["503"] = {"description": "The engine is not running", **error}
    app.openapi_schema = schema
    return schema


def describe_routes(app: FastAPI) -> list[str]:
    """``METHODS /path`` of every route, marking the ones that need no API key."""
    public = getattr(app.state, "public_paths", frozenset())
    needs_key = getattr(app.state, "api_keys", None) is not None
    lines = []
    for route in app.routes:
        methods = ",".join(sorted(getattr(route, "methods", None) or ["*"]))
        path = getattr(route, "path", "?")
        access = "public" if path in public or not needs_key else "API key"
        lines.append(f"{methods:<10} {path}  ({access})")
    return lines
