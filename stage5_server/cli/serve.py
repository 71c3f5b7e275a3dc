"""``stagedserve serve [MODEL]``: build the engine, wrap it in the app, run uvicorn.

    stagedserve serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key 'KEY [group=NAME]']... [engine flags]

Engine flags use vLLM's names and are made from the engine argument table (``ENGINE_ARG_TABLE`` in
``config/__init__.py``); only those given reach ``LLM(...)``. The server's own flags become one ``ServerConfig``
(``options.py``) for ``create_app``. API keys come from ``--api-key`` or else ``STAGEDSERVE_API_KEY``
(command lines show in ``ps``); ``'KEY group=NAME'`` puts a key in a trust group (the key is always
the whole first word, as vLLM takes it). The engine core runs in a process of its own unless
``--no-engine-process``; ``--data-parallel-size N`` runs N cores (``data_parallel/launcher.py``) and
``--api-server-count A`` A API servers on one port (``cli/api_servers.py``).

vLLM: ``vllm/entrypoints/cli/serve.py`` and ``run_server`` in ``vllm/entrypoints/openai/api_server.py``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from stage5_server.arg_types import non_negative_float, parse_size, port, positive_int
from stage5_server.cli.options import (
    API_KEY_ENV,
    add_limit_flags,
    add_media_flags,
    log_api_keys,
    log_engine,
    log_level,
    server_config_from,
)
from stage5_server.config import ENGINE_ARG_TABLE
from stage5_server.data_parallel.routing import LEAST_LOADED, ROUTING_POLICIES

logger = logging.getLogger("stagedserve")

# The engine thread and the event loop share one GIL; a shorter switch interval than
# Python's 5 ms default keeps the loop from waiting a whole slice to stream a token.
SWITCH_INTERVAL_S = 0.0005
# The engine core in its own process by default? Decided by measurement: docs/serving.md.
DEFAULT_ENGINE_PROCESS = True
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def add_serve_subcommand(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve MODEL (a Hugging Face model directory, a .gguf file, or one of "
                                          "the names default, tiny-chat, tiny, small, all-minilm-l6-v2; default: "
                                          "SmolLM2-135M-Instruct) "
                                          "over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model directory, .gguf file or name (default: the default model, SmolLM2-135M-Instruct)")
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    net.add_argument("--port", type=port, default=8000, help="port (default: 8000)")
    net.add_argument("--api-key", action="append", metavar="'KEY [group=NAME]'",
                     help="accept this API key, the whole string (repeatable); 'KEY group=NAME' puts it in trust "
                          f"group NAME. Default: ${API_KEY_ENV} (comma-separated)")
    net.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    net.add_argument("--trust-client-cache-salt", action="store_true",
                     help="accept a client cache_salt (it only partitions the key's own group further)")
    net.add_argument("--metrics-public", action="store_true", help="serve /metrics without an API key")
    net.add_argument("--strict-request-fields", action="store_true",
                     help="answer a top-level request field the route does not define with a 400 (OpenAI's way), "
                          "instead of ignoring it and naming it in the X-Stagedserve-Ignored-Fields header "
                          "(vLLM's way)")
    net.add_argument("--enable-dev-routes", action="store_true",
                     help="serve /sleep, /wake_up, /is_sleeping, /reset_prefix_cache, /collective_rpc and "
                          "/update_weights (behind the API key; turns on --enable-weight-sync; for RL "
                          "post-training: docs/rl-weight-updates.md)")
    net.add_argument("--log-stats-interval", type=non_negative_float, default=10.0,
                     help="seconds between stats log lines; 0 turns them off (default: 10)")
    net.add_argument("--max-body-bytes", type=parse_size, default=None, help="request body limit (default: 4MiB)")
    add_limit_flags(p.add_argument_group("what one request may ask for (docs/reliability.md)"))
    net.add_argument("--uvicorn-log-level", default="info",
                     choices=("critical", "error", "warning", "info", "debug", "trace"))
    net.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=DEFAULT_ENGINE_PROCESS,
                     help="run the engine core in a separate process, HTTP and (de)tokenization in this one "
                          f"(default: {'on' if DEFAULT_ENGINE_PROCESS else 'off'}; see docs/serving.md)")
    net.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                     help="LoRA adapters served from the start (PEFT directories; needs --enable-lora); run-time "
                          "loading also needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    chat = p.add_argument_group("chat: tools and the chat template")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='tool_choice "auto": read tool calls out of the model\'s text (needs --tool-call-parser)')
    chat.add_argument("--tool-call-parser", choices=("hermes",), default=None,  # server.tool_parsers.TOOL_PARSERS
                      help="the format the model writes tool calls in")
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      help="render a chat_template sent with a request (a template is code the server runs)")
    chat.add_argument("--allow-control-tokens-in-messages", action="store_true",
                      help="tokenize control-token strings inside messages as control tokens (trusted callers "
                           "only: any caller could then forge a system turn or a tool result)")
    add_media_flags(p.add_argument_group("images: where they may come from (docs/multimodal.md)"))
    add_engine_flags(p.add_argument_group("engine (only the flags you give are passed to the engine)"))
    top = p.add_argument_group("serving topology")
    top.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                     help="N engine cores, each a whole model replica with its own scheduler and KV cache; on "
                          "CUDA rank d uses GPUs d*TP .. d*TP+TP-1, on CPU each gets cores/N threads (default: 1)")
    top.add_argument("--api-server-count", type=positive_int, default=None, metavar="A",
                     help="A API-server processes sharing the port (default: N)")
    top.add_argument("--dp-routing", choices=ROUTING_POLICIES, default=LEAST_LOADED,
                     help="how an API server picks the engine core of a request: the least loaded one, or the one "
                          "that was sent the same prompt prefix unless it is much busier (default: least-loaded)")
    top.add_argument("--shutdown-timeout", type=non_negative_float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                     metavar="SECONDS", help="on SIGTERM or Ctrl-C, stop accepting and let requests in flight "
                                             f"finish for up to this long (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.set_defaults(func=serve)


def add_engine_flags(group) -> None:
    """A flag for each engine argument of ``ENGINE_ARG_TABLE`` (``config/__init__.py``) that has one. Its default is
    None, not the engine's: a flag left out is not passed, and the engine's own default applies."""
    for arg in ENGINE_ARG_TABLE:
        if not arg.cli:
            continue
        if arg.is_flag:
            group.add_argument(arg.flag, *arg.aliases, dest=arg.name, action=argparse.BooleanOptionalAction,
                               default=None, help=arg.help)
        else:
            group.add_argument(arg.flag, *arg.aliases, dest=arg.name, type=arg.type, choices=arg.choices,
                               default=None, metavar=arg.metavar, help=arg.help)


def build_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user actually set, as ``LLM(**kwargs)`` takes them (the dev routes' weight
    updates and sleep need the engine's: ``--enable-dev-routes`` turns them on unless the user said otherwise)."""
    kwargs = {arg.name: getattr(args, arg.name) for arg in ENGINE_ARG_TABLE
              if arg.cli and getattr(args, arg.name, None) is not None}
    if getattr(args, "enable_dev_routes", False):
        kwargs.setdefault("enable_weight_sync", True)
    return kwargs


# A server is sized for many clients at once, the offline ``LLM`` for a course's small runs (16
# sequences, 512 tokens a step). vLLM's own split: ``EngineArgs.get_batch_defaults`` in
# ``vllm/engine/arg_utils.py``, per usage context (``OPENAI_API_SERVER``) and device; on a CPU
# both are per rank (x tensor- and pipeline-parallel ranks).
SERVER_BATCH_DEFAULTS = {"cpu": {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
                         "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 2048}}


def server_batch_defaults(engine_kwargs: dict[str, Any]) -> dict[str, int]:
    """The batch limits a server gets where the user set none (the flags given win)."""
    import torch

    device = str(engine_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = "cuda" if device.startswith("cuda") else "cpu"
    ranks = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1)
    scale = ranks if kind == "cpu" else 1
    return {name: value * scale for name, value in SERVER_BATCH_DEFAULTS[kind].items() if name not in engine_kwargs}


def server_compile_default(engine_kwargs: dict[str, Any]) -> dict[str, bool]:
    """A server compiles its compiled step in the background, so that it answers while it compiles
    (``model/compile.py``), unless the flag says otherwise."""
    return {} if "compile_in_background" in engine_kwargs else {"compile_in_background": True}


def resolve_topology(args: argparse.Namespace) -> None:
    """Fill in ``--api-server-count`` (N when DP > 1, else 1) and refuse what cannot run."""
    if args.api_server_count is None:
        args.api_server_count = args.data_parallel_size
    if not args.engine_process and (args.data_parallel_size > 1 or args.api_server_count > 1):
        raise ValueError("engine_process: --data-parallel-size and --api-server-count above 1 need the engine "
                         "core in its own process; drop --no-engine-process")


def serving_process_count(api_server_count: int, data_parallel_size: int, tensor_parallel_size: int,
                          pipeline_parallel_size: int = 1) -> dict:
    """The seeds' A + DP + N (+1 coordinator when DP > 1); N is DP x TP x PP when the model is split, else 0
    (the model runs in the engine-core process); with A > 1 a supervisor holds the socket and serves no request."""
    split = tensor_parallel_size * pipeline_parallel_size
    workers = data_parallel_size * split if split > 1 else 0
    counts = {"api_servers": api_server_count, "engine_cores": data_parallel_size, "workers": workers,
              "coordinator": 1 if data_parallel_size > 1 else 0, "supervisor": 1 if api_server_count > 1 else 0}
    counts["total"] = sum(counts.values())
    return counts


def configure_logging(level: str = "info") -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                            datefmt="%m-%d %H:%M:%S")
    logger.setLevel(log_level(level))


def serve(args: argparse.Namespace) -> int:
    configure_logging(args.uvicorn_log_level)
    try:
        engine_kwargs = build_engine_kwargs(args)
        batch_defaults = server_batch_defaults(engine_kwargs)
        server_config = server_config_from(args)
        resolve_topology(args)
        if server_config.lora_modules and not engine_kwargs.get("enable_lora"):
            raise ValueError("lora_modules: adapters are served only with --enable-lora")
    except ValueError as exc:
        print(f"stagedserve serve: error: {exc}", file=sys.stderr)
        return 2
    _log_topology(args, engine_kwargs)
    if batch_defaults:
        logger.info("server batch defaults: %s (the flags override them)",
                    " ".join(f"{name}={value}" for name, value in batch_defaults.items()))
    if args.api_server_count > 1:
        from shared.named_models import default_model, resolve_model
        from stage5_server.cli.api_servers import run_multi_api_server

        resolve_model(args.model) if args.model else default_model()  # a .gguf converted once, before the cores
        return run_multi_api_server(args, args.model, engine_kwargs, server_config,
                                    {**batch_defaults, **server_compile_default(engine_kwargs)})
    import uvicorn

    from stage5_server.core.cpu_threads import configure_frontend_threads
    from stage5_server.engine import make_async_llm
    from stage5_server.server import create_app

    if args.engine_process:
        configure_frontend_threads()  # the model runs in the engine process: its threads get the cores
    engine = None
    try:
        engine = make_async_llm(args.model, engine_process=args.engine_process,
                                data_parallel_size=args.data_parallel_size, dp_routing=args.dp_routing,
                                log_stats_interval=server_config.log_stats_interval, **batch_defaults,
                                **server_compile_default(engine_kwargs), **engine_kwargs)
        app = create_app(engine, server_config)
    except ValueError as exc:
        if engine is not None:
            engine.shutdown()
        print(f"stagedserve serve: error: {exc}", file=sys.stderr)
        return 2
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again once it is done;
    # SIGTERM's default action would end this process there, before the engine is stopped.
    previous_sigterm = signal.signal(signal.SIGTERM, _exit_after_sigterm)
    try:
        _log_configuration(args, app, engine, engine_kwargs)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=args.shutdown_timeout)
    except _SigtermExit:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        engine.shutdown()  # after uvicorn's graceful shutdown: the engine process never outlives the server
    return 0


class _SigtermExit(Exception):
    pass


def _exit_after_sigterm(signum, frame) -> None:
    raise _SigtermExit


def _log_topology(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
    tp, pp = engine_kwargs.get("tensor_parallel_size", 1), engine_kwargs.get("pipeline_parallel_size", 1)
    counts = serving_process_count(args.api_server_count, args.data_parallel_size, tp, pp)
    logger.info("serving processes: %d API server(s) + %d engine core(s) + %d model-parallel worker(s) + %d "
                "coordinator%s = %d (A=%d, DP=%d, TP=%d, PP=%d; routing %s)", counts["api_servers"],
                counts["engine_cores"], counts["workers"], counts["coordinator"],
                " + 1 supervisor" if counts["supervisor"] else "", counts["total"], args.api_server_count,
                args.data_parallel_size, tp, pp, args.dp_routing)


def _log_configuration(args: argparse.Namespace, app, engine, engine_kwargs: dict[str, Any]) -> None:
    from stage5_server.server.openapi import describe_routes

    serving, config = app.state.serving, app.state.server_config
    log_engine(engine.model_path, serving.served_model_name, engine_kwargs, engine.stage, engine.engine_args)
    if not engine.engine_process:
        logger.info("engine core: a thread of the server process")
    elif len(engine.engine_pids) == 1:
        logger.info("engine core: separate process (pid %d)", engine.engine_pid)
    else:
        logger.info("engine cores: %d data-parallel rank(s) (pids %s)", len(engine.engine_pids),
                    ", ".join(map(str, engine.engine_pids)))
    logger.info("server: host=%s port=%d trust_client_cache_salt=%s metrics_public=%s max_body_bytes=%d "
                "log_stats_interval=%s strict_request_fields=%s", args.host, args.port, config.trust_client_cache_salt,
                config.metrics_public, config.max_body_bytes, config.log_stats_interval or "off",
                config.strict_request_fields)
    log_api_keys(args, config.api_keys, app.state.api_keys.groups if config.api_keys else [])
    for line in describe_routes(app):
        logger.info("route: %s", line)
