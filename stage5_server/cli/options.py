"""What the single-process server (``serve.py``) and the multi-API-server supervisor
(``api_servers.py``) both take from the parsed ``stagedserve serve`` flags: the server's options as
one ``ServerConfig`` (``server_config_from``), and the log lines that describe them."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stage5_server.server.config import ServerConfig

logger = logging.getLogger("stagedserve")

API_KEY_ENV = "STAGEDSERVE_API_KEY"
# The secret of the prefix-cache salts, shared by servers that must salt alike (a prefill and a decode
# instance: kv_transfer/p2p.py); unset, each server draws its own.
CACHE_SALT_SECRET_ENV = "STAGEDSERVE_CACHE_SALT_SECRET"
MIN_CACHE_SALT_SECRET_CHARS = 32
DEFAULT_SERVED_MODEL_NAME = "stagedserve-default"


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    """The server's options from its flags (and the keys from ``$STAGEDSERVE_API_KEY`` unless ``--api-key``,
    the salts' secret from ``$STAGEDSERVE_CACHE_SALT_SECRET``), checked: a ValueError names a bad one."""
    from stage5_server.server.config import ServerConfig
    from stage5_server.server.limits import DEFAULT_MAX_BODY_BYTES
    from stage5_server.server.lora_models import parse_lora_modules

    return ServerConfig(api_keys=resolve_api_keys(args.api_key, os.environ.get(API_KEY_ENV)),
                        served_model_name=args.served_model_name or args.model or DEFAULT_SERVED_MODEL_NAME,
                        trust_client_cache_salt=args.trust_client_cache_salt, metrics_public=args.metrics_public,
                        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                        log_stats_interval=args.log_stats_interval or None, chat_options=chat_options_from(args),
                        limits=request_limits_from(args), media=media_options_from(args),
                        lora_modules=tuple(parse_lora_modules(args.lora_modules)),
                        enable_dev_routes=getattr(args, "enable_dev_routes", False),
                        strict_request_fields=getattr(args, "strict_request_fields", False),
                        cache_salt_secret=cache_salt_secret(os.environ.get(CACHE_SALT_SECRET_ENV)))


def cache_salt_secret(value: str | None) -> bytes | None:
    if not value:
        return None
    if len(value) < MIN_CACHE_SALT_SECRET_CHARS:
        raise ValueError(f"{CACHE_SALT_SECRET_ENV}: at least {MIN_CACHE_SALT_SECRET_CHARS} characters "
                         f"(e.g. from `openssl rand -hex 32`), got {len(value)}")
    return value.encode()


GROUP_PREFIX = "group="  # ``--api-key "KEY group=NAME"``: a key holds no whitespace, so this cannot be one


def resolve_api_keys(cli_keys: list[str] | None, env_value: str | None) -> dict[str, str | None] | None:
    """``--api-key`` values (or else the env var's comma-separated list) -> ``{key: group or None}``.

    An entry is ``KEY`` or ``KEY group=NAME``. The key is the whole first word, colons and all (as vLLM
    takes it): nothing inside a key is ever read as a group, so no spelling of a key weakens it, and
    an error never repeats one."""
    entries = cli_keys if cli_keys else [e for e in (env_value or "").split(",") if e.strip()]
    if not entries:
        return None
    keys: dict[str, str | None] = {}
    for i, entry in enumerate(entries, start=1):
        words = entry.split()
        if not words:
            raise ValueError(f"api_key: entry #{i} is empty (expected KEY or 'KEY group=NAME')")
        key, group = words[0], None
        if len(words) > 1:
            if len(words) != 2 or not words[1].startswith(GROUP_PREFIX) or words[1] == GROUP_PREFIX:
                raise ValueError(f"api_key: entry #{i} must be KEY or 'KEY group=NAME' (a key holds no "
                                 "whitespace)")
            group = words[1][len(GROUP_PREFIX):]
        if key in keys:
            raise ValueError(f"api_key: entry #{i} repeats a key given before it")
        if group is None and ":" in key:
            logger.warning("API key #%d contains ':'; the whole string is the key (a trust group is given as "
                           "'KEY group=NAME', not KEY:GROUP)", i)
        keys[key] = group
    return keys


def log_level(uvicorn_level: str) -> int:
    """``--uvicorn-log-level`` -> the level of stagedserve's own log lines."""
    return logging.DEBUG if uvicorn_level in ("debug", "trace") else logging.INFO


def chat_options_from(args: argparse.Namespace):
    """The tool-calling and chat-template flags as the server reads them (a ValueError names a bad one)."""
    from stage5_server.server.chat_options import ChatOptions

    return ChatOptions(enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                       trust_request_chat_template=args.trust_request_chat_template,
                       control_tokens_in_messages=args.allow_control_tokens_in_messages)


def add_media_flags(group) -> None:
    """Where images may come from (``server/media.py``); the caps are vLLM's environment variables."""
    from stage5_server.arg_types import positive_int

    group.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                       help="hosts whose http(s) image URLs the server fetches (default: none, data: URLs only)")
    group.add_argument("--allow-private-media-addresses", action="store_true",
                       help="fetch from hosts that resolve to loopback, private or link-local addresses (a trusted "
                            "network only: otherwise a caller reaches internal services through the server)")
    group.add_argument("--max-images-per-request", type=positive_int, default=8, metavar="N",
                       help="the most images one request may carry (default: 8)")
    group.add_argument("--trust-request-mm-kwargs", action="store_true",
                       help="accept per-request mm_processor_kwargs / media_io_kwargs (trusted callers only)")


def media_options_from(args: argparse.Namespace):
    """The media flags, with VLLM_MEDIA_URL_ALLOW_REDIRECTS, VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB and
    VLLM_IMAGE_FETCH_TIMEOUT from the environment."""
    from stage5_server.server.media import MediaOptions

    return MediaOptions.from_env(allowed_media_domains=args.allowed_media_domains,
                                 allow_private_addresses=args.allow_private_media_addresses,
                                 trust_request_mm_kwargs=args.trust_request_mm_kwargs,
                                 max_images_per_request=args.max_images_per_request)


def add_limit_flags(group) -> None:
    """The ``RequestLimits`` caps as flags (``server/limits.py``): ``--max-prompts-per-request`` and so on."""
    from stage5_server.arg_types import positive_int
    from stage5_server.server.limits import FLAGS, RequestLimits

    helps = {"max_prompts_per_request": "prompts in one completion request",
             "max_messages_per_request": "messages of one conversation (Responses: input items), and the content "
                                         "parts of its messages",
             "max_tools_per_request": "tools of one request",
             "max_logit_bias_per_request": "entries of one request's logit_bias",
             "max_choices_per_request": "choices of one request: prompts x n",
             "max_logprobs_per_request": "logprobs one request may ask for per token: prompts x n x logprobs",
             "max_returned_logprobs_per_request": "logprobs one request may return in all: prompts x n x max_tokens "
                                                  "x (logprobs + 1)",
             "max_structured_output_bytes": "bytes of one structured-output constraint (as JSON)"}
    for name, flag in FLAGS.items():
        group.add_argument(flag, type=positive_int, default=getattr(RequestLimits, name),
                           help=f"the most {helps[name]} (default: {getattr(RequestLimits, name)})")


def request_limits_from(args: argparse.Namespace):
    from stage5_server.server.limits import FLAGS, RequestLimits

    return RequestLimits(**{name: getattr(args, name) for name in FLAGS})


def log_engine(model_path: str, served_model_name: str, engine_kwargs: dict, stage: str, engine_args: dict) -> None:
    logger.info("model: %s (served as %r)", model_path, served_model_name)
    logger.info("engine arguments from the command line: %s", engine_kwargs or "(none)")
    logger.info("resolved engine configuration (%s): %s", stage,
                ", ".join(f"{k}={v}" for k, v in sorted(engine_args.items())))


def log_api_keys(args: argparse.Namespace, api_keys: dict[str, str | None] | None, groups: list[str]) -> None:
    if api_keys:
        source = "--api-key" if args.api_key else f"${API_KEY_ENV}"
        logger.info("API keys: %d from %s, trust groups: %s", len(api_keys), source, ", ".join(groups))
    elif _is_loopback(args.host):
        logger.warning("no API key: every route is open to anyone who can reach %s", args.host)
    else:
        logger.warning("no API key and host %s is not loopback: anyone on the network can use this server; "
                       "set --api-key or %s", args.host, API_KEY_ENV)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
