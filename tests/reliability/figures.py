"""The figures the reliability suite reports: how many operations, requests and faults each test survived.

Tests call ``count(section, name, n)``; the suite's conftest adds up the counts of every
process (xdist workers included) and, when ``RELIABILITY_FIGURES=path.json`` is set,
writes them there at the end of the run. docs/reliability.md quotes the committed file.
"""

from __future__ import annotations

import os
from collections import defaultdict

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
        with open(self.path, "w") as f:
            args = " ".join(session.config.invocation_params.args)
            ci = "CI=1 " if os.environ.get("CI") else ""
            json.dump({"command": f"{ci}RELIABILITY_FIGURES={self.path} python -m pytest {args}",
                       "derandomized": bool(os.environ.get("CI")), "figures": figures}, f, indent=2)
            f.write("\n")

    def pytest_testnodedown(self, node, error) -> None:
        import json

        data = getattr(node, "workeroutput", {}).get("reliability_figures")
        if data:
            merge(self.totals, json.loads(data))
