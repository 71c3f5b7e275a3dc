"""The site check (scripts/check_site.py) fails on what a reader would see broken, and passes a clean page.

It runs on tiny hand-written pages in headless Chromium, so it needs the system's chromium
(``apt-get install -y chromium``) and playwright; CI has both. ``make docs-check`` runs the
same check over the real site.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from check_site import CHROMIUM, check_site  # noqa: E402

pytest.importorskip("playwright")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason="needs the system chromium")]

PAGE = """<!doctype html><html><head><style>
.md-content__inner {{ width: 400px; }} pre > code {{ display: block; overflow: auto; white-space: pre; }}
</style></head><body><div class="md-content__inner md-typeset">{body}</div></body></html>"""


def write(site: Path, path: str, body: str) -> None:
    page = site / path / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(PAGE.format(body=body))


def test_raw_diagram_text_clipped_blocks_and_network_use_fail_and_a_clean_page_passes(tmp_path):
    write(tmp_path, ".", "<p>A clean page.</p><pre><code>short line</code></pre>")
    write(tmp_path, "raw", '<pre class="mermaid"><code>flowchart LR\n  A --> B</code></pre>')
    write(tmp_path, "wide", "<pre><code>" + "x" * 400 + "</code></pre>")
    write(tmp_path, "cdn", '<script src="https://unpkg.com/mermaid@11/dist/mermaid.min.js"></script><p>hi</p>')
    problems = check_site(tmp_path, screenshots=tmp_path / "shots")
    assert problems["/"] == []
    assert any("raw mermaid text" in p for p in problems["/raw/"])
    assert any("clipped" in p for p in problems["/wide/"])
    assert any("needs the network: https://unpkg.com" in p for p in problems["/cdn/"])
    assert (tmp_path / "shots" / "index.png").is_file() and (tmp_path / "shots" / "wide.png").is_file()


def test_a_page_that_could_fetch_from_another_host_fails_even_when_this_visit_does_not(tmp_path):
    # As a notebook template does: the module is imported from a CDN only if the page has a diagram.
    guarded = ('<script type="module">if (document.querySelector(".jp-Mermaid")) {'
               ' const m = (await import("https://cdnjs.cloudflare.com/ajax/libs/mermaid/x/mermaid.esm.min.mjs"));'
               ' }</script><p>no diagram here</p>')
    write(tmp_path, "guarded", guarded)
    write(tmp_path, "style", '<link rel="stylesheet" href="https://fonts.example.org/a.css"><p>hi</p>')
    write(tmp_path, "link", '<p><a href="https://github.com/vllm-project/vllm">a link is no fetch</a></p>')
    problems = check_site(tmp_path, screenshots=None)
    assert not any("needs the network" in p for p in problems["/guarded/"])  # nothing was requested ...
    assert any("could fetch from elsewhere: https://cdnjs.cloudflare.com" in p for p in problems["/guarded/"])
    assert any("https://fonts.example.org/a.css" in p for p in problems["/style/"])
    assert problems["/link/"] == []


def test_a_console_error_and_a_replay_that_shows_no_step_fail_and_a_replay_that_loads_passes(tmp_path):
    root = Path(__file__).resolve().parent.parent
    assets = tmp_path / "assets"
    (assets / "inspector").mkdir(parents=True)
    (assets / "replays").mkdir()
    shutil.copy(root / "stage5_server" / "inspector" / "static" / "inspector.js", assets / "inspector")
    shutil.copy(root / "docs" / "assets" / "replays" / "worked_example.json", assets / "replays")
    script = '<script src="/assets/inspector/inspector.js"></script>'
    write(tmp_path, "replay", script + '<div data-inspector="replay" data-trace="worked_example"></div>')
    write(tmp_path, "missing", script + '<div data-inspector="replay" data-trace="no_such_trace"></div>')
    write(tmp_path, "console", '<script>console.error("something broke")</script><p>hi</p>')
    problems = check_site(tmp_path, screenshots=None)
    assert problems["/replay/"] == []
    assert any("replay no_such_trace shows no step" in p for p in problems["/missing/"])
    assert any(p.startswith("console error:") for p in problems["/missing/"])  # the trace's 404
    assert problems["/console/"] == ["console error: something broke"]
