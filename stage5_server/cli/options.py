"""What the single-process server (``serve.py``) and the multi-API-server supervisor
(``api_servers.py``) both take from the parsed ``stagedserve serve`` flags."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("stagedserve")

API_KEY_ENV = "STAGEDSERVE_API_KEY"


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
             "max_messages_per_request": "messages of one conversation (Responses: input items)",
             "max_choices_per_request": "choices of one request: prompts x n",
             "max_logprobs_per_request": "logprobs one request may ask for per token: prompts x n x logprobs",
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
