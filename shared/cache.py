"""Where this project keeps what it builds once per machine, and how: the converted default model
(``gguf.py``), the course's tiny checkpoints (``course/tiny_model.py``), the compiled CPU operators.

``cache_dir()`` is ``$STAGEDSERVE_CACHE``, else ``~/.cache/stagedserve``; ``build_once`` builds a directory
into a temporary one beside it and renames it, so two processes never see half a build.

vLLM keeps its own under ``~/.cache/vllm`` (``VLLM_CACHE_ROOT``, ``vllm/envs.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("STAGEDSERVE_CACHE") or Path.home() / ".cache" / "stagedserve"
    return Path(root)


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """``target``, a checkpoint directory that ``build(directory)`` writes, built only if no run has
    yet: into a temporary directory beside it, then renamed (atomic, safe across processes)."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
