"""mkdocs hook: the inspector's script and stylesheet, from the package, on the course site.

The course's replays (``docs/watch.md``) use the very viewer a server serves at ``/inspect``
(``stage5_server/inspector/static/``); this hook adds those two files to the site as
``assets/inspector/``, so there is one copy of them. ``mkdocs.yml`` loads them on every page; a page
without a ``data-inspector`` element is left alone. The traces they replay are
``docs/assets/replays/*.json``, written by ``scripts/record_replays.py``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

STATIC = Path(__file__).resolve().parent.parent / "stage5_server" / "inspector" / "static"
FILES = ("inspector.js", "inspector.css")


def on_files(files, config):
    for name in FILES:
        files.append(File.generated(config, f"assets/inspector/{name}", abs_src_path=str(STATIC / name)))
    return files
