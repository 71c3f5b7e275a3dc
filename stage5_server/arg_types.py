"""Argument types: each parses one command-line value or raises ``argparse.ArgumentTypeError`` saying
what was expected. The engine argument table (``config/__init__.py``) names them for its flags, the ``stagedserve``
subcommands (``cli/``, ``bench/cli.py``) for theirs; this module imports nothing of the project.

vLLM: the type functions beside ``EngineArgs`` in ``vllm/engine/arg_utils.py`` (``human_readable_int``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def _bounded(kind: type, what: str, ok: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """A type that parses ``kind`` and refuses a value ``ok`` rejects: "must be {expected}"."""

    def parse(text: str):
        value = _number(text, kind, what)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


positive_int = _bounded(int, "an integer", lambda v: v >= 1, "an integer >= 1")
non_negative_int = _bounded(int, "an integer", lambda v: v >= 0, "an integer >= 0")
positive_float = _bounded(float, "a number", lambda v: 0 < v < math.inf, "a positive number")
non_negative_float = _bounded(float, "a number", lambda v: 0 <= v < math.inf, "a number >= 0")
fraction = _bounded(float, "a number", lambda v: 0 < v <= 1, "in (0, 1]")


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1.5GiB"``, ``"1048576"`` -> bytes (K/M/G alone are binary)."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 2GiB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def port(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}")
    return value


def json_object(text: str) -> dict:
    """A JSON object, e.g. ``--speculative-config '{"method": "ngram", ...}'`` (its keys are checked later)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def checked_json_object(check: Callable[[dict], object]) -> Callable[[str], dict]:
    """A type for a flag that takes a JSON object (``--speculative-config``, ``--kv-transfer-config``): the
    object, refused as the command line is read (before any engine process starts) when ``check``
    raises a ``ValueError`` for it."""

    def parse(text: str) -> dict:
        value = json_object(text)
        try:
            check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return parse


def json_object_argument(name: str, value: str | dict, accepted: tuple[str, ...]) -> dict:
    """An engine argument given as a JSON object (``speculative_config``, ``kv_transfer_config``): ``value``
    as a dict, or its JSON text, with only ``accepted`` keys; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not JSON ({exc.msg}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(accepted))
    if unknown:
        raise ValueError(f"{name}: unknown key {unknown[0]!r}; accepted: {list(accepted)}")
    return value
