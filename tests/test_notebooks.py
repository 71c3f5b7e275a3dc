"""The course site's moving parts: every notebook runs, every nav page and snippet include exists.

The notebook tests execute each stored notebook top to bottom with nbclient on the
``python3`` kernel (resolved to this interpreter), from the repository root, as the docs
build and a reader would. The link tests keep ``mkdocs build --strict`` from failing on a
page or ``--8<--`` include that someone renamed or has not written yet.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOTEBOOKS = sorted((DOCS / "notebooks").glob("*.ipynb"))
INCLUDE = re.compile(r"""^\s*--8<--\s+["']([^"']+)["']""", re.MULTILINE)


def _nav_pages(node) -> list[str]:
    """Every page path in mkdocs.yml's nav (strings, lists and dicts nested any way)."""
    if isinstance(node, str):
        return [] if node.startswith(("http://", "https://")) else [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def _load_nav() -> list[str]:
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):  # mkdocs.yml may carry !!python/name tags (e.g. the mermaid fence)
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    return _nav_pages(config["nav"])


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"stage1_slab.ipynb", "stage2_block_tables.ipynb", "stage3_scheduler.ipynb",
            "stage4_prefix_cache.ipynb", "stage5_server.ipynb", "all_stages.ipynb"} <= names


def _builder():
    pytest.importorskip("nbformat")
    sys.path.insert(0, str(DOCS / "notebooks"))
    import build_notebooks

    return build_notebooks


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_stored_notebook_is_what_the_builder_writes(path):
    import nbformat

    builder = _builder()
    stored = nbformat.read(path, as_version=4)
    built = builder.build(path.name)
    assert [(c.cell_type, c.source, c.get("metadata", {}).get("tags", [])) for c in stored.cells] == [
        (c.cell_type, c.source, c.get("metadata", {}).get("tags", [])) for c in built.cells], (
        f"rerun: .venv/bin/python docs/notebooks/build_notebooks.py {path.name}")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_runs_from_a_clean_kernel_and_gives_its_stored_outputs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    builder = _builder()
    # The kernelspec's argv[0] is "python": put this interpreter's directory first so it
    # resolves to the same environment (jupyter_client also maps "python" to sys.executable).
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.chdir(ROOT)
    stored = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # a clean state: nothing of the stored run is left
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    elapsed = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    # The stored outputs are this run's: the prose was written against them, so a notebook whose
    # outputs moved must be rebuilt (and its prose read again).
    stale = []
    for i, (old, new) in enumerate(zip(stored.cells, nb.cells)):
        before, after = builder.comparable_outputs(old), builder.comparable_outputs(new)
        if old.cell_type == "code" and before != after:
            stale.append(f"cell {i}: stored {before!r}\n    now {after!r}")
    assert not stale, (f"{path.name}: stored outputs are stale; rerun .venv/bin/python "
                       f"docs/notebooks/build_notebooks.py {path.name} and read its prose again:\n" + "\n".join(stale))
    print(f"{path.name}: {elapsed:.1f} s")


def test_the_staleness_check_ignores_times_and_addresses_but_not_text_or_other_numbers():
    nbformat = pytest.importorskip("nbformat")
    builder = _builder()

    def cell(text: str, tags=()):
        c = nbformat.v4.new_code_cell("", metadata={"tags": list(tags)})
        c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text),
                     nbformat.v4.new_output("stream", name="stderr", text="a warning, 12.5 it/s")]
        return c

    same = builder.comparable_outputs
    assert same(cell("model: default\nsteps 8 <object at 0x7f3a2b1c4d50>")) == same(
        cell("model: default\nsteps 8 <object at 0x7f00aa00bb11>"))
    assert same(cell("ran in 1.25 s, 3 steps", ["timing"])) == same(cell("ran in 0.97 s, 3 steps", ["timing"]))
    assert same(cell("p50 12.5  p99   3.1", ["timing"])) == same(cell("p50   102.5  p99 13.1", ["timing"]))
    assert same(cell("model: tiny-chat\n")) != same(cell("model: gguf-SmolLM2\n"))
    assert same(cell("acceptance 75%")) != same(cell("acceptance 50%"))  # untagged: every number counts
    assert same(cell("AMX: yes", ["machine"])) == same(cell("AMX: no", ["machine"]))


def test_every_nav_page_exists():
    missing = [page for page in _load_nav() if not (DOCS / page).is_file()]
    assert not missing, f"nav names pages that do not exist under docs/: {missing}"


def test_every_snippet_include_target_exists():
    missing = []
    for page in sorted(DOCS.rglob("*.md")):
        for target in INCLUDE.findall(page.read_text(encoding="utf-8")):
            path = target.split(":", 1)[0]  # "file.md:section" and "file.md:10:20" include part of a file
            if not (ROOT / path).is_file():  # snippets base_path is the repo root
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, f"--8<-- includes whose file is missing: {missing}"


def test_every_include_says_in_a_line_what_it_includes_to_a_reader_of_the_file():
    # On a forge or in an editor the page shows the --8<-- line, not what it includes: the line
    # above it (a paragraph of class file-note, which the site hides) names the file.
    INCLUDE_LINE = re.compile(r"""^\s*--8<--\s+["']([^"':]+)""")
    silent = []
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            found = INCLUDE_LINE.match(line)
            if not found:
                continue
            before = [b for b in lines[max(0, i - 4):i] if 'class="file-note"' in b]
            if not any(f"<code>{found.group(1)}</code>" in b for b in before):
                silent.append(f"{page.name}:{i + 1} {found.group(1)}")
    assert not silent, f"add a <p class=\"file-note\"> line naming the included file above: {silent}"
