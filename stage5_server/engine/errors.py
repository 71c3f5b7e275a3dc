"""What can go wrong with a request once it is in an engine, as exceptions the server maps to HTTP.

Every layer that runs a request raises these (the front end, the engine-core loop, tensor
parallelism), so they live apart from all of them. vLLM: ``vllm/v1/engine/exceptions.py``.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed while running this request; the request was aborted (HTTP 500)."""


class EngineDeadError(EngineError):
    """The engine core has stopped (shut down or crashed); no request can run (HTTP 503)."""


class RequestAborted(Exception):
    """The request was aborted before it finished (``abort``, or its client went away)."""
