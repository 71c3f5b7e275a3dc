"""The ``stagedserve`` command: ``serve``, ``chat``, ``complete``, ``make-tiny-model``, ``bench`` and
``disagg-proxy``.

Each subcommand's module adds its own parser (``serve.py``, ``client.py``, ``tiny_model.py``,
``stage5_server/bench/cli.py``, ``stage5_server/kv_transfer/proxy.py``), whose
``set_defaults(func=handler)`` names the function that runs it, ``handler(args) -> int | None``.

vLLM: ``vllm/entrypoints/cli/main.py``.
"""

from __future__ import annotations

import argparse
import sys

from stage5_server.cli.client import add_client_subcommands
from stage5_server.cli.serve import add_serve_subcommand
from stage5_server.cli.tiny_model import add_make_tiny_model_subcommand


def make_parser() -> argparse.ArgumentParser:
    from stage5_server.bench.cli import add_bench_subcommands
    from stage5_server.kv_transfer.proxy import add_disagg_proxy_subcommand

    parser = argparse.ArgumentParser(prog="stagedserve", description="The stagedserve LLM serving engine.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_subcommand(subparsers)
    add_client_subcommands(subparsers)
    add_make_tiny_model_subcommand(subparsers)
    add_bench_subcommands(subparsers)
    add_disagg_proxy_subcommand(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
