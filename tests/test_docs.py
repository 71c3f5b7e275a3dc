"""The course pages keep their promises: every term is in the glossary, every recorded output is current.

- The reading path says every term the pages use is in the glossary: each phrase a page sets in
  bold as a term, and each abbreviation in its prose, must be a glossary entry or an alias of one.
- A snippet's recorded output (the ``.txt`` a page includes) is what the snippet prints today.
- The course speaks of the project only: no planning language in pages or benchmark reports.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if p.name != "glossary.md")

# Bold that is emphasis or a name, not a term to define.
EMPHASIS = {"stagedserve", "the page", "the package docstring", "the code that changed", "the notebook",
            "the tests", "killed the engine thread", "at a steady request rate below saturation",
            "gpu numbers", "a failed model step failed every request in flight", "a rust panic in the tokenizer",
            "server", "full", "blocks", "preempts", "prefill and chunked prefill", "writing k/v"}
# Abbreviations of general computing that the course does not define.
GENERAL = {"API", "CPU", "GPU", "HTTP", "JSON", "URL", "TCP", "TLS", "CI", "OS", "SDK", "README", "MB", "GB", "TB",
           "KiB", "GiB", "POST", "GET", "SIGTERM", "SIGINT", "H200", "L2", "UTC", "ID", "IDs", "OK", "AMD", "NVIDIA",
           "FIFO", "AI", "YAML", "CSS", "HTML", "PNG", "SVG", "CDN", "PDF", "RAM", "SHA", "UC", "UTF"}
# Placeholders in prose ('KEY group=NAME') and the letters that stand for tokens (A B C D ...).
PLACEHOLDERS = {"KEY", "GROUP", "STAGE", "MODEL", "TASK", "DONE", "IFACE", "ABCD", "EFGH", "EFXY", "FIFO"}


def _normal(term: str) -> str:
    term = re.sub(r"[`*_]", "", term).strip().lower()
    term = re.sub(r"\s+", " ", term)
    term = re.sub(r"^(the|a|an) ", "", term.rstrip(".:,;"))
    return term[:-1] if term.endswith("s") and len(term) > 3 and not term.endswith("ss") else term


def glossary_terms() -> set[str]:
    terms = set()
    for line in (DOCS / "glossary.md").read_text().splitlines():
        m = re.match(r"^\*\*(.+?)\*\*(?:\s*\((.+)\))?\s*$", line)
        if not m:
            continue
        names = [m.group(1)] + (m.group(2).split(",") if m.group(2) else [])
        for name in names:
            for part in re.split(r",| or ", name):  # "**R0, R1**", "**bf16, fp32**"
                if part.strip():
                    terms.add(_normal(part))
    return terms


def prose(text: str) -> str:
    """The page without code blocks, code spans, includes, link targets and html."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"^ {4,}```.*?^ {4,}```", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"^\s*--8<--.*$", "", text, flags=re.MULTILINE)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"<[^>]+>", "", text)


def test_the_glossary_defines_what_the_course_requires():
    terms = glossary_terms()
    required = ["prefill", "decode", "static batching", "continuous batching", "SLO", "PagedAttention", "GQA",
                "split-K", "TTFT", "ITL", "TPOT", "goodput", "preemption", "chunked prefill", "prefix caching",
                "trust group", "KV cache", "block table", "cache salt", "token budget"]
    assert [t for t in required if _normal(t) not in terms] == []


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_bold_term_and_abbreviation_on_a_page_is_in_the_glossary(page):
    terms = glossary_terms()
    text = prose(page.read_text())
    missing = set()
    # A bullet's bold lead-in ("- **The file**: ...") names the item; it is not a term.
    text = re.sub(r"^(\s*[-*]\s+)\*\*[^*\n]+\*\*", r"\1", text, flags=re.MULTILINE)
    for phrase in re.findall(r"\*\*([^*\n]+?)\*\*", text):
        if phrase.rstrip().endswith((".", ":", "!", "?")) or "(" in phrase or len(phrase.split()) > 4:
            continue  # a paragraph's lead-in, not a term
        if _normal(phrase) not in terms and _normal(phrase) not in {_normal(e) for e in EMPHASIS}:
            missing.add(phrase)
    for word in re.findall(r"\b[A-Z][A-Za-z0-9]*[A-Z0-9]s?\b", text):
        plain = word[:-1] if word.endswith("s") and word[:-1].isupper() else word
        if not plain.isupper() or len(plain) < 2 or re.fullmatch(r"R\d", plain):
            continue
        if plain not in GENERAL and plain not in PLACEHOLDERS and _normal(plain) not in terms:
            missing.add(plain)
    assert not missing, f"{page.name}: add these to docs/glossary.md (or unbold them): {sorted(missing)}"


# (script, its arguments, the recorded output the pages include)
SNIPPETS = [
    ("docs/snippets/kv_cache_size.py", [], "docs/snippets/kv_cache_size.txt"),
    ("docs/snippets/goodput_ab.py", [], "docs/snippets/goodput_ab.txt"),
    ("docs/snippets/budget6_trace.py", [], "docs/snippets/budget6_trace.txt"),
    ("docs/snippets/budget6_trace.py", ["--apc"], "docs/snippets/budget6_trace_apc.txt"),
    ("docs/snippets/prefix_cache_demo.py", [], "docs/snippets/prefix_cache_demo.txt"),
    ("docs/snippets/parallel_sampling_cache.py", [], "docs/snippets/parallel_sampling_cache.txt"),
    ("docs/snippets/spec_decode_trace.py", [], "docs/snippets/spec_decode_trace.txt"),
    ("docs/snippets/mm_block_hashes.py", [], "docs/snippets/mm_block_hashes.txt"),
    ("docs/snippets/lora_cache_key.py", [], "docs/snippets/lora_cache_key.txt"),
]


@pytest.mark.parametrize(("script", "args", "recorded"), SNIPPETS, ids=[Path(s[2]).stem for s in SNIPPETS])
def test_a_snippets_recorded_output_is_what_it_prints(script, args, recorded):
    done = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (ROOT / recorded).read_text(), f"rerun: {script} {' '.join(args)} > {recorded}"


def test_the_course_figures_are_what_their_script_draws():
    done = subprocess.run([sys.executable, "scripts/course_figures.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


PLANNING = re.compile(r"\bgoals?\b|\bengineer'?s?\b|\bTODO\b", re.IGNORECASE)


def test_pages_and_benchmark_reports_speak_of_the_project_only():
    files = [*DOCS.rglob("*.md"), *DOCS.rglob("*.txt"), ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    found = [f"{f.relative_to(ROOT)}: {m.group(0)!r}" for f in files for m in PLANNING.finditer(f.read_text())]
    assert not found, found


@pytest.mark.parametrize("stage_number", [1, 2, 3, 4, 5])
def test_what_changed_on_each_stage_page_is_computed_from_the_code(stage_number):
    sys.path.insert(0, str(ROOT / "scripts"))
    from stage_diff import snippet_path, stage_change

    assert snippet_path(stage_number).read_text() == stage_change(stage_number), (
        "run: python scripts/stage_diff.py --write")
