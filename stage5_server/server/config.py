"""``ServerConfig``: the server's own options (not the engine's), checked once.

Who may call (``api_keys`` and their trust groups, ``auth.py``), the model name clients send, the
cache-salt secret, what one request may ask for (``limits``, ``max_body_bytes``), whether a field a
route does not define is ignored or refused (``strict_request_fields``), where images may come from
(``media``), the chat switches (``chat_options``) and the LoRA adapters served from the start.
``create_app(engine, config)`` takes one, or its fields as keywords; ``stagedserve serve`` builds one
from its flags (``cli/options.py``), and with ``--api-server-count`` above 1 every API server gets the
same one (it pickles).

vLLM: ``FrontendArgs`` in ``vllm/entrypoints/openai/cli_args.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stage5_server.server.auth import APIKeys
from stage5_server.server.chat_options import ChatOptions
from stage5_server.server.limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from stage5_server.server.media import MediaOptions


@dataclass(frozen=True)
class ServerConfig:
    """The server's options; a bad one is a ValueError that names it, raised here, before any app is built."""

    # {key: trust group or None}, or a list of keys; None: no authentication (loopback only). Never in a repr.
    api_keys: Mapping[str, str | None] | Sequence[str] | None = field(default=None, repr=False)
    served_model_name: str | None = None  # None: the engine's model path
    trust_client_cache_salt: bool = False  # a client cache_salt partitions its key's group further
    metrics_public: bool = False  # /metrics without a key
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_stats_interval: float | None = 10.0  # seconds between stats lines of the engine the server runs; None: off
    # None: a random one (the API servers of one port share theirs)
    cache_salt_secret: bytes | None = field(default=None, repr=False)
    chat_options: ChatOptions = ChatOptions()
    limits: RequestLimits = RequestLimits()
    media: MediaOptions | None = None  # None: MediaOptions.from_env() when the app is built
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of each adapter served from the start
    enable_dev_routes: bool = False  # /sleep, /wake_up, /update_weights, /collective_rpc ... (dev_routes.py)
    strict_request_fields: bool = False  # an undefined top-level request field: a 400, not ignored (request_fields.py)

    def __post_init__(self) -> None:
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be a positive integer, got {self.max_body_bytes!r}")
        if self.api_keys is not None:
            APIKeys(self.api_keys)  # a ValueError names a bad key or group
        # create_app's keywords took None for "the defaults" and any sequence of pairs
        object.__setattr__(self, "chat_options", self.chat_options or ChatOptions())
        object.__setattr__(self, "limits", self.limits or RequestLimits())
        object.__setattr__(self, "lora_modules", tuple((name, path) for name, path in self.lora_modules))
