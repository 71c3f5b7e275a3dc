"""The two messages of an engine-core utility call (a weight update, sleep, ``collective_rpc``): the core's
message unions (``core/messages.py``) take them in, as they take every other message.

vLLM: ``EngineCoreRequestType.UTILITY`` and ``UtilityOutput`` in ``vllm/v1/engine/__init__.py``.
"""

from __future__ import annotations

import msgspec


class UtilityCall(msgspec.Struct, tag="utility"):
    """Run an engine-core utility between steps (``weight_sync/``): a weight update, sleep, ``collective_rpc``.
    ``payload``: the pickled ``(args, kwargs)`` (tensors, a function); only the API server sends it."""

    call_id: int
    method: str
    payload: bytes
    client_id: str | None = None


class UtilityOutput(msgspec.Struct, tag="utility_output"):
    """A ``UtilityCall``'s answer: the pickled result, or the error (``error_type``: its class's name)."""

    call_id: int
    result: bytes = b""
    error: str | None = None
    error_type: str = ""
    engine_index: int = 0
