"""The figures the reliability suite reports: how many operations, requests and faults each test survived.

Tests call ``count(section, name, n)``; a plugin (registered by tests/conftest.py when
``RELIABILITY_FIGURES=path.json`` is set) adds up the counts of every process, xdist workers
included, and writes them there at the end of the run, plus a Markdown table to
``RELIABILITY_FIGURES_MD`` if that is set. docs/reliability.md includes the committed table.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

FIGURES: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def count(section: str, name: str, n: int = 1) -> None:
    FIGURES[section][name] += n


def merge(into: dict[str, dict[str, int]], other: dict[str, dict[str, int]]) -> None:
    for section, counts in other.items():
        for name, n in counts.items():
            into[section][name] += n


def snapshot() -> dict[str, dict[str, int]]:
    return {section: dict(sorted(counts.items())) for section, counts in sorted(FIGURES.items())}


class FiguresPlugin:
    """Adds up every process's figures and writes them to ``path`` at the end of the run."""

    def __init__(self, path: str):
        self.path = path
        self.totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def pytest_sessionfinish(self, session) -> None:
        import json

        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: hand the figures to the controller
            workeroutput["reliability_figures"] = json.dumps(snapshot())
            return
        merge(self.totals, snapshot())
        if not self.totals:
            return
        figures = {section: dict(sorted(counts.items())) for section, counts in sorted(self.totals.items())}
        args = " ".join(session.config.invocation_params.args)
        env = " ".join(f"{name}={os.environ[name]}" for name in ("CI", "SOAK_SECONDS", "SOAK_CLIENTS",
                                                                 "RELIABILITY_FIGURES", "RELIABILITY_FIGURES_MD")
                       if os.environ.get(name))
        result = {"command": f"{env} python -m pytest {args}", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()),
                  "outcome": "passed" if session.testsfailed == 0 else f"{session.testsfailed} failed",
                  "tests": session.testscollected, "derandomized": bool(os.environ.get("CI")), "figures": figures}
        with open(self.path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        markdown = os.environ.get("RELIABILITY_FIGURES_MD")
        if markdown:
            with open(markdown, "w") as f:
                f.write(render_markdown(result))

    @pytest.hookimpl(optionalhook=True)  # an xdist hook: absent with -p no:xdist
    def pytest_testnodedown(self, node, error) -> None:
        import json

        data = getattr(node, "workeroutput", {}).get("reliability_figures")
        if data:
            merge(self.totals, json.loads(data))


SECTIONS = {
    "block_allocator": "Stage 2 block allocator (state machine)",
    "kv_cache_manager_stage3": "Stage 3 KV cache manager (state machine)",
    "scheduler_stage3": "Stage 3 scheduler + fake runner (state machine)",
    "scheduler_stage4": "Stage 4 scheduler with prefix caching + fake runner (state machine)",
    "scheduler_stage5_spec": "Stage 5 scheduler verifying drafts + fake runner (state machine)",
    "api_fuzz": "Live server fuzzed from its OpenAPI schema",
    "soak": "Soak: concurrent streaming clients on loopback",
    "soak_engine_process": "Soak, engine core in its own process",
    "soak_dp2": "Soak, two data-parallel engine cores",
    "faults": "Injected faults",
    "security": "Security: error bodies and logs scanned",
}


def render_markdown(result: dict) -> str:
    lines = [f"`{result['command'].strip()}` on {result['date']}: {result['tests']} tests, {result['outcome']}"
             f"{' (hypothesis derandomized, as in CI)' if result['derandomized'] else ''}.", "",
             "| what ran | figure | count |", "|---|---|---:|"]
    for section, counts in result["figures"].items():
        title = SECTIONS.get(section, section)
        for name, n in counts.items():
            lines.append(f"| {title} | {name.replace('_', ' ')} | {n} |")
            title = ""
    return "\n".join(lines) + "\n"
