"""What every benchmark shares: the run's provenance and where its results go."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path


def run_info(module: str, argv: list[str] | None) -> dict:
    """Date, machine and the exact command line (no absolute paths)."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"system": platform.system(), "machine": platform.machine(),
                    "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version()},
        "command": " ".join(["python", "-m", module, *map(shlex.quote, args)]),
    }


def write_results(name: str, result: dict, markdown_text: str, out_dir: str | Path, markdown_path: str | Path) -> None:
    """``<out_dir>/<name>.json`` for the numbers, the markdown table for the docs; echo the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
    Path(markdown_path).write_text(markdown_text)
    print(markdown_text)


def save_figure(fig, path: str | Path) -> None:
    """Lay out, write and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
