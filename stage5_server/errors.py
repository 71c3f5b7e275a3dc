"""What can go wrong with a request once it is in an engine, as exceptions the server maps to HTTP.

Every layer that runs a request raises these (the front end, the engine-core loop, tensor
parallelism), so they live apart from all of them. vLLM: ``vllm/v1/engine/exceptions.py``.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed while running this request; the request was aborted (HTTP 500)."""


class EngineDeadError(EngineError):
    """The engine core has stopped (shut down or crashed); no request can run (HTTP 503)."""


class EngineSleepingError(EngineDeadError):
    """The engine refuses new requests for now: it sleeps, or woke from a level-2 sleep and awaits weights
    (``weight_sync/``), as the core's admission check says (``EngineCore.refusal``). HTTP 503; not dead: waking it
    (and, after level 2, a weight update) serves again."""


class RequestAborted(Exception):
    """The request was aborted before it finished (``abort``, or its client went away)."""


class ContextLengthExceeded(ValueError):
    """The prompt, or the prompt and ``max_tokens``, do not fit in ``max_model_len``; ``param`` names which
    (HTTP 400, ``context_length_exceeded``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


class StepFailed(RuntimeError):
    """A step's forward pass raised: the requests in it were aborted (their KV freed). The core can step
    again, unless the cause is an ``EngineDeadError`` (``engine_dead``)."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(str(cause))
        self.request_ids, self.cause = request_ids, cause

    @property
    def engine_dead(self) -> bool:
        return isinstance(self.cause, EngineDeadError)
