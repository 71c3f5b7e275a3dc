"""The course's layering, measured: one command that prints the table the stage 5 reference page carries.

    python scripts/layering_report.py [--json FILE] [--verbose] [--static-only]

The course promises (docs/stage5-reference.md, "Which room may import which") that ``shared/`` and
stages 1-4 stay what a learner of those stages needs, and that every stage-5 feature lives in its own room behind a
seam. This script measures how far the code keeps that promise, so a redesign can show a before and
an after made by the same command. Every count of lines is of NON-BLANK lines of ``.py`` files;
modules and rooms are located by file path, never by a private name.

Rows:

1. ``shared/`` lines: every ``.py`` file under ``shared/``.
2. What a stage-1 learner reaches: ``stage1_naive``'s own modules plus every first-party module
   (``shared/`` and ``stage*/``) they import, transitively; modules and their lines.
   (a) static: every ``import`` / ``from ... import`` statement anywhere in a file (module level,
   inside functions, under ``if TYPE_CHECKING:``); ``from a.b import c`` reaches module ``a.b.c``
   when that is a module, else ``a.b``; the parent packages' ``__init__.py`` count too (importing
   ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py``). Dynamic imports
   (``importlib.import_module``) are not statements and are not followed.
   (b) at import: the first-party modules in ``sys.modules`` after ``import stage1_naive`` in a
   fresh interpreter.
3. Modules one streaming chat request passes. A real server, built by the public entry points
   (``make_async_llm`` + ``create_app``, uvicorn on 127.0.0.1, the engine arguments of
   ``tests/stage5/server_fixtures.py``, the tiny random checkpoint of
   ``course.tiny_model.cached_tiny_model``, or ``tiny-chat`` if that had no chat template), serves
   one warm-up streaming chat completion, then the measured one (another prompt, ``max_tokens`` 8,
   temperature 0), both sent with httpx. Every thread is traced with ``threading.setprofile`` /
   ``sys.setprofile``. The window opens ``SETTLE_S`` after the warm-up's ``data: [DONE]``, just
   before the measured request is sent, and closes ``SETTLE_S`` after its ``data: [DONE]`` (so the
   engine's clean-up of the finished request falls inside). COUNTED: the first-party modules (files
   under ``shared/`` and ``stage*/``, ``__init__.py`` included) of which at least one Python function
   -- a code object whose ``co_filename`` is that file -- was called, or resumed as a generator or
   coroutine, in the window (a profiler ``call`` event). Not counted: a module whose code only ran
   as the caller of something, in a frame entered before the window (``--verbose`` lists such
   modules as "ran, not entered"; there are none today); C functions; modules only imported.
   Start-up (model load; the compiled decode step, which the float32 tiny model does not use) and
   the warm-up are outside the window, and the periodic stats logger is off
   (``log_stats_interval=None``) so no timer fires in the window by chance. Two modes:
   (a) thread mode (``engine_process=False``): API and engine core in one process, one number;
   (b) engine-process mode (``engine_process=True``): the API process is traced in process; the
   engine-core process by this module's ``trace_engine_core``, which it loads through
   ``STAGEDSERVE_ENGINE_PLUGINS`` (``stage5_server/core/plugins.py``) once its core is built. Both
   tracers record, per function, the ``time.monotonic()`` intervals in which it was called (one
   clock for every process on the machine); the engine's writes its records every
   ``DUMP_INTERVAL_S`` to a file in the directory ``LAYERING_TRACE_DIR`` names, and the parent keeps
   what intersects its window. Reported: in thread mode, ``stage5_server``'s own modules, the lower
   stages' (1-4) and ``shared``'s, a row each; in engine-process mode, API-process modules /
   engine-process modules / their union (distinct module names); and, in each mode, how many of the
   modules live in a feature's room (``FEATURES``' rooms: none should, on a server without the
   features). ``--verbose`` lists every module with the functions that made it count. Earlier
   estimates of this row ("about 41 modules") had no definition; compare against the numbers this
   definition gives, not against such estimates.
4. ``stage5_server`` lines without ``bench/`` and ``kernels/``.
5. Lines each stage-5 feature (weight sync among them) adds outside its room: every non-blank line
   (code, comment or docstring) of a ``.py`` file in ``shared/``, stages 1-4 and ``stage5_server``
   (less ``bench/`` and the feature's own room) that names the feature, by the word table ``FEATURES`` below. A word
   matches case-insensitively at a word-ish start (not preceded by a letter or digit, or at a
   camel-case hump: ``enable_lora``, ``MaxLoRA``, ``num_draft_tokens`` match; ``Albert``,
   ``division`` do not) and may go on (``drafts``, ``adapters``); false friends (the table's
   ``false_friends`` and ``COMMON_FALSE_FRIENDS``) are blanked out of a line before it is matched.
6. Stage-5 feature words in ``shared/`` and stages 1-4: lines matching ``STAGE5_WORDS`` (the
   design's expression, ``\\b`` boundaries as written, so a snake_case compound such as ``enable_lora`` or
   ``num_draft_tokens`` is seen only by row 5), with ``COMMON_FALSE_FRIENDS`` blanked out first.
7. Import cycles between ``stage5_server`` rooms: a room is a direct subpackage or a top-level
   module of ``stage5_server`` (its ``__init__.py`` is the room ``__init__``). An edge A -> B is an
   import statement in A (module level or inside a function, but not under ``if TYPE_CHECKING:``)
   of a module of B, by the module it names (``from a.b import c``: ``a.b.c`` if a module, else
   ``a.b``; parent packages are not edges), never A -> A. Counted: the elementary cycles of that
   graph (``--verbose`` lists them, with one import that makes each edge). Two more rows count the
   imports under ``if TYPE_CHECKING:`` too: the room edges that exist for type hints alone, and the
   two-way room pairs once every import counts (``tests/test_layout.py`` holds this at zero).

``--static-only`` skips row 3 (a few seconds instead of about twenty). Nothing is downloaded: the tiny
checkpoint is built locally if it is not cached, and every process the script starts is stopped.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
STAGE5 = "stage5_server"
STAGE1 = "stage1_naive"


# ---------------------------------------------------------------------------------------------------------------------
# The word table (rows 5 and 6): review here.
# ---------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Feature:
    name: str
    rooms: tuple[str, ...]  # paths under the repository (folders or files): the feature's own code
    words: tuple[str, ...]  # regular expressions, matched case-insensitively at a word-ish start
    false_friends: tuple[str, ...] = ()  # regular expressions blanked out of a line before matching (case-sensitive)
    room_globs: tuple[str, ...] = ()  # more rooms: globs under stage5_server


FEATURES: tuple[Feature, ...] = (
    Feature("speculative decoding", rooms=("stage5_server/spec_decode", "stage5_server/config/speculative.py"),
            words=("spec_decode", "spec_token", "speculative", "draft", "proposer", "ngram", "rejection")),
    Feature("LoRA", rooms=("stage5_server/lora", "stage5_server/config/lora.py"),
            words=("lora", "adapter"),
            false_friends=(r"\bTypeAdapter\b",)),  # pydantic's, not a LoRA adapter
    Feature("pooling", rooms=("stage5_server/pooling", "stage5_server/config/pooler.py"),
            # "embed", "embedding(s)" only as a word or an identifier's start ("embedding model", EmbeddingRequest,
            # convert="embed"): as an identifier's tail (max_position_embeddings, RotaryEmbedding) it is the model's
            # embedding layer, and "embeds" are a decoder's input embeddings (images).
            words=("pooling", "pooler", "pooled", "bert", "encoder", r"(?<![a-z0-9_])embed(?:dings?)?(?-i:(?![a-z]))"),
            false_friends=(
                # a decoder's own embedding layer
                r"\bembed_tokens\b", r"\bembed_head\b", r"\bembedding_(?:length|dim)\b", r"\b(?:F|nn)\.[Ee]mbedding\b",
                r"(?:\b(?:[Pp]osition(?:al)?|[Rr]otary|[Tt]oken|[Ii]nput|[Ww]ord|[Tt]ied|[Pp]added)|\(segment\)) "
                r"embeddings?\b",
                r"\b(?:[Ii]ts|[Tt]he|head's) embedding(?:'s)?\b",
                r"(?<![\w.])embed(?= = |\.\w| is )",  # a variable holding a checkpoint's token-embedding tensor
                # msgspec's encoder (core/messages.py): its definition, its uses, its name in import lists
                r"\bMsgpack(?:En|De)coder\b", r"\bmsgpack\.Encoder\b", r"(?<![\w.])encoder(?= = msgspec|\.encode\b|,)",
                # the vision tower's (multimodal/): its encoder and its patch, class and position embeddings
                r"\bCLIPEncoder\w*", r"\bself\.(?:encoder|embeddings)\b", r"\b(?:transformer|vision) encoder\b",
                r"\b\w*mm_encoder\b", r"\bmultimodal\.encoder\b",
                r"\b(?:multimodal/)?encoder(?:\.py\b|_cache_manager\b| cache\b| work\b)",
                r"\b(?:[Ii]mage's|placeholders'|these) embeddings\b", r"\bembeddings are added\b",
                r"\bembedding output\b", r"\bone embedding per\b",
            )),
    Feature("images", rooms=("stage5_server/multimodal", "stage5_server/config/multimodal.py"),
            words=("mm_", "multimodal", "multi_modal", "image", "vision", "llava", "placeholder")),
    Feature("pipeline parallelism", rooms=("stage5_server/parallel/pipeline.py",),
            words=("pipeline", "pp_", "batch_queue"),
            room_globs=("**/pipeline*",)),
    Feature("KV transfer", rooms=("stage5_server/kv_transfer", "stage5_server/config/kv_transfer.py"),
            words=("kv_transfer", "kv_connector", "connector", "kv_offload", "offload", "p2p", "filled_block",
                   "disagg"),
            # image fetching's connector (server/media.py)
            false_friends=(r"\bMediaConnector\b", r"\bself\.connector = connector\b", r"\bself\.connector\b",
                           r"(?<![\w.])connector(?=: MediaConnector)")),
    Feature("weight sync", rooms=("stage5_server/weight_sync", "stage5_server/config/weight_sync.py"),
            words=("weight_?sync", r"weight[ _]version", "update_weights", "reload_weights", r"weight[ _-]updates?",
                   "sleep", "wake_up"),
            false_friends=(r"\b(?:time|asyncio)\.sleep\b",)),  # waiting, not the engine's sleep
)

# Blanked out of every line for every feature and for row 6: names that contain a feature's word but
# are about something else.
COMMON_FALSE_FRIENDS: tuple[str, ...] = (
    r"\bfree_block_queue\b", r"\b\w*block_pool\w*\b", r"\b\w*BlockPool\w*\b",  # stage 4's KV blocks
    r"\b\w*(?:Thread|Process)Pool\w*\b", r"\b(?:thread|process|worker|connection) pool\b",  # executors
)

# Row 6: the design's expression, as written.
STAGE5_WORDS = r"\b(lora[a-z_]*|mm_[a-z_]+|spec_[a-z_]+|draft[a-z_]*|pooled[a-z_]*|bert[a-z_]*|vision[a-z_]*" \
               r"|image[a-z_]*|pool(ing|er))\b"


def word_regex(words: Iterable[str]) -> re.Pattern[str]:
    """A word-ish start: not after a letter or digit, or an upper-case letter after a lower-case one or a digit."""
    alternatives = "|".join(f"(?:{w})" for w in words)
    return re.compile(rf"(?:(?<![A-Za-z0-9])|(?<=[a-z0-9])(?=[A-Z]))(?i:{alternatives})")


# ---------------------------------------------------------------------------------------------------------------------
# Files, lines, modules.
# ---------------------------------------------------------------------------------------------------------------------

def nonblank_lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def py_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def _pythonpath(*first: Path) -> str:
    """``first``, then the inherited PYTHONPATH."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([*(str(p) for p in first), *inherited]))


def first_party_packages(root: Path) -> list[str]:
    """``shared`` and the stage packages (``stage*``), in order."""
    names = [p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()
             and (p.name == "shared" or re.fullmatch(r"stage\d+_\w+", p.name))]
    return sorted(names, key=lambda n: (n != "shared", n))


class ModuleIndex:
    """Every first-party module, by dotted name and by file."""

    def __init__(self, root: Path = REPO):
        self.root = root
        self.packages = first_party_packages(root)
        self.path_of: dict[str, Path] = {}
        for package in self.packages:
            for path in py_files(root / package):
                self.path_of[self.module_name(path)] = path
        self.name_of = {path.resolve(): name for name, path in self.path_of.items()}

    def module_name(self, path: Path) -> str:
        parts = list(path.resolve().relative_to(self.root.resolve()).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)

    def module_of_file(self, filename: str) -> str | None:
        """The first-party module whose file this is, or None."""
        try:
            return self.name_of.get(Path(filename).resolve())
        except (OSError, ValueError):
            return None

    def is_package(self, name: str) -> bool:
        return self.path_of[name].name == "__init__.py"

    def lines(self, names: Iterable[str]) -> int:
        return sum(nonblank_lines(self.path_of[n]) for n in names)


@dataclass(frozen=True)
class ImportStatement:
    lineno: int
    named: tuple[str, ...]  # the first-party modules the statement names (its targets)
    runs: tuple[str, ...]  # those and their parent packages: what executing it may run
    type_checking: bool  # under ``if TYPE_CHECKING:``


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_imports(node: ast.AST, type_checking: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, type_checking
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _walk_imports(child, True)
        for child in node.orelse:
            yield from _walk_imports(child, type_checking)
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk_imports(child, type_checking)


def imports_of(index: ModuleIndex, module: str) -> list[ImportStatement]:
    """The import statements of ``module`` that reach first-party modules, anywhere in its file."""
    path = index.path_of[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if index.is_package(module) else module.rpartition(".")[0]
    statements = []
    for node, type_checking in _walk_imports(tree):
        named: list[str] = []
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        else:
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in index.path_of]
            named = submodules or [base]
            if submodules and len(submodules) < len(node.names):
                named.append(base)  # names besides the submodules come from the package itself
        named = [n for n in named if n in index.path_of]
        if not named:
            continue
        runs: list[str] = []
        for name in named:
            parts = name.split(".")
            runs += [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in index.path_of]
        statements.append(ImportStatement(node.lineno, tuple(dict.fromkeys(named)), tuple(dict.fromkeys(runs)),
                                          type_checking))
    return statements


def static_reach(index: ModuleIndex, start: Iterable[str]) -> set[str]:
    """``start`` and every first-party module their import statements run, transitively."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for statement in imports_of(index, module):
            todo += [m for m in statement.runs if m not in seen]
    return seen


def import_time_reach(index: ModuleIndex, package: str) -> set[str]:
    """The first-party modules (by file) in ``sys.modules`` after ``import package`` in a fresh interpreter."""
    code = ("import json, sys; import " + package + "; "
            "print(json.dumps([getattr(m, '__file__', None) for m in list(sys.modules.values())]))")
    env = {**os.environ, "PYTHONPATH": _pythonpath(index.root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=index.root, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    files = json.loads(out.strip().splitlines()[-1])
    return {m for m in (index.module_of_file(f) for f in files if f) if m}


# ---------------------------------------------------------------------------------------------------------------------
# Feature words (rows 5 and 6).
# ---------------------------------------------------------------------------------------------------------------------

def _blank(patterns: Iterable[str]) -> re.Pattern[str] | None:
    patterns = list(patterns)
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def matching_lines(files: Iterable[Path], word: re.Pattern[str], false_friends: Iterable[str],
                   root: Path = REPO, code_only: bool = False) -> dict[str, list[tuple[int, str]]]:
    """Per file (relative path), the non-blank lines that match ``word`` once the false friends are blanked out
    (``code_only``: with comments and docstrings taken out first, ``code_text``)."""
    blank = _blank(false_friends)
    hits: dict[str, list[tuple[int, str]]] = {}
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        texts = code_text(path) if code_only else dict(enumerate(lines, 1))
        for lineno, text in texts.items():
            if not text.strip():
                continue
            text = blank.sub(" ", text) if blank else text
            if word.search(text):
                hits.setdefault(str(path.relative_to(root)), []).append((lineno, lines[lineno - 1].strip()))
    return hits


def code_text(path: Path) -> dict[int, str]:
    """Each line of a module as code: comments cut off, docstrings (a string standing as a statement) and
    the lines they span left out."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    prose: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose.update(range(node.lineno, node.end_lineno + 1))
    comments: dict[int, int] = {}  # line -> column where its comment starts
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
    return {n: line[:comments[n]] if n in comments else line
            for n, line in enumerate(lines, 1) if n not in prose}


def feature_rooms(feature: Feature, root: Path = REPO) -> list[Path]:
    rooms = [root / r for r in feature.rooms]
    for pattern in feature.room_globs:
        rooms += [p for p in (root / STAGE5).glob(pattern) if p.suffix == ".py" or p.is_dir()]
    return sorted(set(rooms))


def feature_scope(feature: Feature, root: Path = REPO) -> list[Path]:
    """Every ``.py`` of shared/, the stages and stage5_server, less ``stage5_server/bench`` and the feature's rooms."""
    excluded = [root / STAGE5 / "bench", *feature_rooms(feature, root)]
    files = []
    for package in first_party_packages(root):
        for path in py_files(root / package):
            if not any(path == room or room in path.parents for room in excluded):
                files.append(path)
    return files


def feature_lines_outside(feature: Feature, root: Path = REPO,
                          code_only: bool = False) -> dict[str, list[tuple[int, str]]]:
    return matching_lines(feature_scope(feature, root), word_regex(feature.words),
                          [*COMMON_FALSE_FRIENDS, *feature.false_friends], root, code_only)


def stage5_words_before_stage5(root: Path = REPO) -> dict[str, list[tuple[int, str]]]:
    files = [p for package in first_party_packages(root) if package != STAGE5 for p in py_files(root / package)]
    return matching_lines(files, re.compile(STAGE5_WORDS, re.IGNORECASE), COMMON_FALSE_FRIENDS, root)


# ---------------------------------------------------------------------------------------------------------------------
# Rooms of stage5_server and their import cycles (row 7).
# ---------------------------------------------------------------------------------------------------------------------

def room_of(module: str, top: str = STAGE5) -> str | None:
    parts = module.split(".")
    if parts[0] != top:
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def room_graph(index: ModuleIndex, top: str = STAGE5,
               type_checking: bool | None = False) -> dict[str, dict[str, list[str]]]:
    """``{room: {room it imports: ["file:line", ...]}}``. ``type_checking``: False, the imports that run (those
    under ``if TYPE_CHECKING:`` left out); True, those alone; None, both."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in sorted(index.path_of.items()):
        source = room_of(module, top)
        if source is None:
            continue
        graph.setdefault(source, {})
        for statement in imports_of(index, module):
            if type_checking is not None and statement.type_checking != type_checking:
                continue
            for target in statement.named:
                room = room_of(target, top)
                if room is not None and room != source:
                    where = f"{path.relative_to(index.root)}:{statement.lineno}"
                    graph[source].setdefault(room, []).append(where)
    return graph


CYCLE_LIMIT = 100_000


def simple_cycles(graph: dict[str, Iterable[str]], limit: int = CYCLE_LIMIT) -> list[list[str]]:
    """The elementary cycles of a small directed graph, each from its least node (at most ``limit``)."""
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    order = {n: i for i, n in enumerate(nodes)}
    cycles: list[list[str]] = []

    def extend(start: str, path: list[str], on_path: set[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if len(cycles) >= limit:
                return
            if nxt == start:
                cycles.append(list(path))
            elif order[nxt] > order[start] and nxt not in on_path:
                on_path.add(nxt)
                path.append(nxt)
                extend(start, path, on_path)
                path.pop()
                on_path.discard(nxt)

    for start in nodes:
        extend(start, [start], {start})
    return cycles


# ---------------------------------------------------------------------------------------------------------------------
# One streaming chat request, traced (row 3).
# ---------------------------------------------------------------------------------------------------------------------

TRACE_DIR_ENV = "LAYERING_TRACE_DIR"
PLUGINS_ENV = "STAGEDSERVE_ENGINE_PLUGINS"
PLUGIN = "layering_report:trace_engine_core"  # importable with scripts/ on the path (PYTHONPATH below)
GAP_S = 0.01  # calls of one function closer than this merge into one interval; the window is far longer
DUMP_INTERVAL_S = 0.1
SETTLE_S = 0.25
MAX_TOKENS = 8
API_KEY = "layering-report"
SERVED_NAME = "tiny"
# As tests/stage5/server_fixtures.py: small and quick on a CPU.
ENGINE_KWARGS = dict(max_model_len=256, max_num_seqs=16, block_size=16, num_kv_blocks=160, max_num_batched_tokens=256)
WARM_UP = "Say hello to the course."
MEASURED = "Name three colours of the rainbow."
_MISSING = object()


class IntervalRecorder:
    """A profile function for every thread: per function (code object), the ``time.monotonic()`` intervals in
    which it was called (``called``) or made a call (``calling``). Only code of files under ``prefixes`` is kept."""

    def __init__(self, prefixes: Iterable[str]):
        self.prefixes = tuple(prefixes)
        self.called: dict[Any, list[list[float]] | None] = {}  # code object -> intervals; None: not first-party
        self.calling: dict[Any, list[list[float]] | None] = {}

    def _note(self, table: dict, code, t: float) -> None:
        intervals = table.get(code, _MISSING)
        if intervals is _MISSING:  # setdefault: atomic, so two threads never keep two lists
            intervals = table.setdefault(code, [] if code.co_filename.startswith(self.prefixes) else None)
        if intervals is None:
            return
        if intervals and t <= intervals[-1][1] + GAP_S:
            last = intervals[-1]
            if t > last[1]:
                last[1] = t
            elif t < last[0]:
                last[0] = t
        else:
            intervals.append([t, t])

    def profile(self, frame, event: str, arg) -> None:
        if event == "call":  # a Python function called, or a generator or coroutine resumed
            t = time.monotonic()
            self._note(self.called, frame.f_code, t)
            if frame.f_back is not None:
                self._note(self.calling, frame.f_back.f_code, t)
        elif event == "c_call":
            self._note(self.calling, frame.f_code, time.monotonic())

    def install(self) -> None:
        threading.setprofile(self.profile)  # threads started from now on
        sys.setprofile(self.profile)  # this one

    @staticmethod
    def uninstall() -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, dict[str, dict[str, list[list[float]]]]]:
        """``{"called" | "calling": {file: {function: intervals}}}``, plain data (JSON)."""
        def copy(table):
            out: dict[str, dict[str, list[list[float]]]] = {}
            for code, intervals in list(table.items()):
                if intervals:
                    name = f"{getattr(code, 'co_qualname', code.co_name)}:{code.co_firstlineno}"
                    out.setdefault(code.co_filename, {})[name] = [list(i) for i in list(intervals)]
            return out

        return {"called": copy(self.called), "calling": copy(self.calling)}


def _first_party_prefixes(root: Path = REPO) -> list[str]:
    return [str((root / p).resolve()) + os.sep for p in first_party_packages(root)]


def modules_in_window(index: ModuleIndex, snapshot: dict, start: float, end: float) -> dict[str, Any]:
    """``called``: ``{module: [its functions called in [start, end]]}``; ``ran_not_entered``: modules whose frames
    only made calls in it (a loop entered before the window), not counted."""
    def in_window(table) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for file, functions in table.items():
            module = index.module_of_file(file)
            names = [f for f, ivs in functions.items() if any(a <= end and b >= start for a, b in ivs)]
            if module and names:
                found.setdefault(module, []).extend(sorted(names))
        return dict(sorted(found.items()))

    called = in_window(snapshot["called"])
    return {"called": called, "ran_not_entered": {m: f for m, f in in_window(snapshot["calling"]).items()
                                                  if m not in called}}


def trace_engine_core(core) -> None:
    """The engine-process tracer, an engine plugin (``STAGEDSERVE_ENGINE_PLUGINS=layering_report:trace_engine_core``):
    records every thread of this process from now on and writes the records to ``$LAYERING_TRACE_DIR``
    every ``DUMP_INTERVAL_S`` (with the time of writing, so the parent knows when they cover its window)."""
    out = Path(os.environ[TRACE_DIR_ENV]) / f"engine-{os.getpid()}.json"
    recorder = IntervalRecorder(_first_party_prefixes())
    untraced = [t.name for t in threading.enumerate() if t is not threading.current_thread()]

    def dump_forever() -> None:
        sys.setprofile(None)  # the dumper is not traced
        while True:
            written_at = time.monotonic()
            draft = out.with_suffix(".draft")
            draft.write_text(json.dumps({"pid": os.getpid(), "written_at": written_at,
                                         "untraced_threads": untraced, **recorder.snapshot()}))
            os.replace(draft, out)
            time.sleep(DUMP_INTERVAL_S)

    recorder.install()
    threading.Thread(target=dump_forever, name="layering-trace-dump", daemon=True).start()


def _pick_model() -> tuple[str, str]:
    """The tiny random checkpoint if it has a chat template, else tiny-chat (which ships with the package)."""
    from course.tiny_model import cached_tiny_model

    path = Path(cached_tiny_model())
    has_template = (path / "chat_template.jinja").is_file() or '"chat_template"' in (
        (path / "tokenizer_config.json").read_text() if (path / "tokenizer_config.json").is_file() else "")
    if has_template:
        return str(path), "tiny (random, cached_tiny_model)"
    from shared import tiny_chat_model

    return str(tiny_chat_model()), "tiny-chat"


class _Uvicorn:
    """uvicorn serving ``app`` on a thread, on a loopback port the OS picks."""

    def __init__(self, app):
        import socket

        import uvicorn

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="layering-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()


def _stream_chat(client, url: str, content: str) -> dict:
    """One streaming chat completion; the text and finish reason it streamed."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": MAX_TOKENS, "temperature": 0}
    text, finish, chunks, done = [], None, 0, False
    with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            chunks += 1
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    if not done:
        raise RuntimeError("the stream ended without data: [DONE]")
    return {"text": "".join(text), "finish_reason": finish, "chunks": chunks}


def _engine_traces(trace_dir: Path, after: float) -> list[dict]:
    """The engine-process tracers' records, once every one was written after ``after`` (they cover the window)."""
    deadline = time.monotonic() + 30
    while True:
        dumps = [json.loads(p.read_text()) for p in sorted(trace_dir.glob("engine-*.json"))]
        if dumps and all(d["written_at"] > after for d in dumps):
            return dumps
        if time.monotonic() > deadline:
            raise RuntimeError(f"no engine-process trace covering the window in {trace_dir}")
        time.sleep(DUMP_INTERVAL_S)


def _serve_and_trace(mode: str, out_file: Path) -> None:
    """In a process of its own: serve, warm up, trace one request, write the modules to ``out_file``."""
    import httpx

    engine_process = mode == "engine-process"
    model, model_label = _pick_model()
    with tempfile.TemporaryDirectory(prefix="layering-trace-") as trace_dir:
        if engine_process:  # inherited by the engine-core process when it is spawned
            os.environ[PLUGINS_ENV] = PLUGIN
            os.environ[TRACE_DIR_ENV] = trace_dir
            os.environ["PYTHONPATH"] = _pythonpath(SCRIPTS, REPO)

        from stage5_server.engine import make_async_llm
        from stage5_server.server import create_app

        index = ModuleIndex()
        recorder = IntervalRecorder(_first_party_prefixes())
        # Every thread started from here on: the engine core's (thread mode), uvicorn's, asyncio's executor. The
        # model is loaded on this thread, before it is traced.
        threading.setprofile(recorder.profile)
        engine = make_async_llm(model, engine_process=engine_process, log_stats_interval=None, **ENGINE_KWARGS)
        server = None
        try:
            app = create_app(engine, api_keys=[API_KEY], served_model_name=SERVED_NAME, log_stats_interval=None)
            server = _Uvicorn(app)
            server.start()
            with httpx.Client(timeout=120) as client:
                warm_up = _stream_chat(client, server.url, WARM_UP)
                time.sleep(SETTLE_S)  # whatever the warm-up left to do is done before the window opens
                sys.setprofile(recorder.profile)  # this thread too (the client: no first-party code runs here)
                start = time.monotonic()
                measured = _stream_chat(client, server.url, MEASURED)
                time.sleep(SETTLE_S)
                end = time.monotonic()
            assert end - start > GAP_S, "the window must be longer than the merge gap"
            api = modules_in_window(index, recorder.snapshot(), start, end)
            engines = [{"pid": d["pid"], "untraced_threads": d["untraced_threads"],
                        **modules_in_window(index, d, start, end)}
                       for d in (_engine_traces(Path(trace_dir), end) if engine_process else [])]
        finally:
            IntervalRecorder.uninstall()
            if server is not None:
                server.stop()
            engine.shutdown()
    result = {"mode": mode, "model": model_label, "window_s": round(end - start, 3), "warm_up": warm_up,
              "measured": measured, "api": api, "engines": engines}
    out_file.write_text(json.dumps(result, indent=1))


def _live_members(pgid: int) -> list[Any]:
    """The processes of group ``pgid`` that have not exited (zombies waiting to be reaped are gone)."""
    import psutil

    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


def _stop_group(pgid: int, grace: float = 10.0) -> list[str]:
    """Give what is left of our process group ``grace`` seconds to exit by itself (multiprocessing's resource
    tracker goes once its parent has), then kill the rest, each by its id; the names of those killed."""
    deadline = time.monotonic() + grace
    while (left := _live_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for process in left:
        try:
            killed.append(f"{process.name()} (pid {process.pid})")
            process.kill()
        except Exception:  # psutil.NoSuchProcess: it went meanwhile
            pass
    return killed


def measure_request(mode: str, timeout: float = 400.0) -> dict:
    """Run ``_serve_and_trace(mode)`` in a fresh interpreter, in a process group of its own; whatever of that
    group outlives it (an engine core whose parent died) is stopped, and said."""
    with tempfile.TemporaryDirectory(prefix="layering-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": _pythonpath(REPO, SCRIPTS)}
        process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--trace-request", mode,
                                    "--trace-out", str(out)], cwd=REPO, env=env, start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            log, _ = process.communicate()
            raise RuntimeError(f"tracing the {mode} request timed out after {timeout:.0f} s:\n{log[-4000:]}") from None
        finally:
            killed = _stop_group(process.pid)  # the group is ours: the tracing process and what it spawned
            if killed:
                print(f"layering_report: killed what the {mode} run left running: {', '.join(killed)}",
                      file=sys.stderr)
        if process.returncode != 0 or not out.is_file():
            raise RuntimeError(f"tracing the {mode} request failed (exit {process.returncode}):\n{log[-4000:]}")
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class Report:
    rows: list[tuple[str, str]] = field(default_factory=list)
    numbers: dict[str, int] = field(default_factory=dict)  # every row's numbers, by a stable key (JSON)
    data: dict = field(default_factory=dict)
    details: list[str] = field(default_factory=list)  # --verbose


def static_report(root: Path = REPO) -> Report:
    """Rows 1, 2, 4, 5, 6 and 7."""
    index = ModuleIndex(root)
    report = Report()
    shared_files = py_files(root / "shared")
    shared_lines = sum(nonblank_lines(p) for p in shared_files)
    report.rows.append(("`shared/` lines", f"{shared_lines:,}"))
    report.numbers["shared_lines"] = shared_lines
    report.data["shared_lines"] = shared_lines
    report.data["shared_lines_by_file"] = {str(p.relative_to(root)): nonblank_lines(p) for p in shared_files}

    own = [m for m in index.path_of if m.split(".")[0] == STAGE1]
    static = static_reach(index, own)
    at_import = import_time_reach(index, STAGE1)
    for label, key, modules in (("static imports", "stage1_static", static),
                                ("at import", "stage1_at_import", at_import)):
        lines = index.lines(modules)
        report.rows.append((f"Lines a stage-1 learner reaches ({label}): modules / lines",
                            f"{len(modules)} / {lines:,}"))
        report.data[key] = {"modules": len(modules), "lines": lines, "module_names": sorted(modules)}
        report.numbers.update({f"{key}_modules": len(modules), f"{key}_lines": lines})
    if static != at_import:
        report.details.append(f"stage 1 reach: static only {sorted(static - at_import)}, "
                              f"at import only {sorted(at_import - static)}")
    report.details.append(f"stage 1 reach (static): {', '.join(sorted(static))}")

    stage5 = [p for p in py_files(root / STAGE5)
              if not {"bench", "kernels"} & set(p.relative_to(root / STAGE5).parts[:1])]
    stage5_lines = sum(nonblank_lines(p) for p in stage5)
    report.data["stage5_lines_without_bench_kernels"] = stage5_lines
    report.data["features_outside_room"] = {}
    feature_rows = []
    for feature in FEATURES:
        hits = feature_lines_outside(feature, root)
        code = feature_lines_outside(feature, root, code_only=True)
        count, code_count = sum(len(v) for v in hits.values()), sum(len(v) for v in code.values())
        feature_rows.append((f"Lines outside its room: {feature.name} (all / code)", f"{count:,} / {code_count:,}"))
        key = re.sub(r'[^a-z]+', '_', feature.name.lower())
        report.numbers[f"outside_room_{key}"] = count
        report.numbers[f"outside_room_code_{key}"] = code_count
        rooms = [str(r.relative_to(root)) for r in feature_rooms(feature, root)]
        report.data["features_outside_room"][feature.name] = {
            "lines": count, "code_lines": code_count, "rooms": rooms, "by_file": {f: len(v) for f, v in hits.items()},
            "code_by_file": {f: len(v) for f, v in code.items()}, "matches": hits}
        report.details.append(f"{feature.name} outside {', '.join(rooms)}: {count} lines, {code_count} of code")
        for file, lines in sorted(hits.items()):
            report.details.append(f"  {file}: {len(lines)} ({len(code.get(file, []))} of code)")
    stage5_words = stage5_words_before_stage5(root)
    words_count = sum(len(v) for v in stage5_words.values())
    report.data["stage5_words_in_shared_and_stages_1_4"] = {
        "lines": words_count, "by_file": {f: len(v) for f, v in stage5_words.items()}, "matches": stage5_words}
    report.details.append(f"stage-5 words in shared/ and stages 1-4: {words_count} lines")
    for file, lines in sorted(stage5_words.items()):
        report.details.append(f"  {file}: {len(lines)}")
        report.details += [f"    {n}: {text[:110]}" for n, text in lines]

    graph = room_graph(index)
    cycles = simple_cycles(graph)
    report.data["room_import_cycles"] = {"cycles": len(cycles), "list": [" -> ".join([*c, c[0]]) for c in cycles],
                                         "edges": {a: sorted(bs) for a, bs in sorted(graph.items())}}
    report.details.append(f"import cycles between stage5_server rooms: {len(cycles)}")
    for cycle in cycles:
        hops = [f"{a} -> {b} ({graph[a][b][0]}{f' +{len(graph[a][b]) - 1}' if len(graph[a][b]) > 1 else ''})"
                for a, b in zip(cycle, [*cycle[1:], cycle[0]])]
        report.details.append("  " + "; ".join(hops))

    full = room_graph(index, type_checking=None)
    typed_only = {(a, b): where for a, bs in room_graph(index, type_checking=True).items() for b, where in bs.items()
                  if b not in graph.get(a, {})}
    pairs = sorted((a, b) for a, bs in full.items() for b in bs if a < b and a in full.get(b, {}))
    report.data["room_type_only_edges"] = {f"{a} -> {b}": where for (a, b), where in sorted(typed_only.items())}
    report.data["room_two_way_pairs"] = [f"{a} <-> {b}" for a, b in pairs]
    report.details.append(f"room imports for type hints alone: {len(typed_only)} edges")
    report.details += [f"  {a} -> {b} ({where[0]})" for (a, b), where in sorted(typed_only.items())]
    report.details.append(f"two-way room pairs, type hints included: {len(pairs)}")
    report.details += [f"  {a} <-> {b}" for a, b in pairs]

    report.numbers.update({"stage5_lines_without_bench_kernels": stage5_lines,
                           "stage5_words_in_shared_and_stages_1_4": words_count, "room_import_cycles": len(cycles),
                           "room_type_only_edges": len(typed_only), "room_two_way_pairs": len(pairs)})
    report.rows += [("`stage5_server` lines without `bench/` and `kernels/`", f"{stage5_lines:,}"), *feature_rows,
                    ("Stage-5 feature words in `shared/` and stages 1-4 (lines)", f"{words_count:,}"),
                    ("Import cycles between `stage5_server` rooms",
                     f"{len(cycles):,}{'+' if len(cycles) >= CYCLE_LIMIT else ''}"),
                    ("Room imports for type hints alone (edges)", f"{len(typed_only):,}"),
                    ("Two-way room pairs, type hints included", f"{len(pairs):,}")]
    return report


def by_layer(modules: Iterable[str]) -> dict[str, list[str]]:
    """Modules as ``stage5_server``'s own, the lower stages' (1-4) and ``shared``'s."""
    layers: dict[str, list[str]] = {"stage5": [], "lower": [], "shared": []}
    for module in sorted(modules):
        top = module.split(".")[0]
        layers["stage5" if top == STAGE5 else "shared" if top == "shared" else "lower"].append(module)
    return layers


def in_feature_rooms(modules: Iterable[str], root: Path = REPO) -> list[str]:
    """The modules that live in a feature's room (``FEATURES``)."""
    index = ModuleIndex(root)
    rooms = [room for feature in FEATURES for room in feature_rooms(feature, root)]
    return sorted(m for m in modules if m in index.path_of and any(
        index.path_of[m] == room or room in index.path_of[m].parents for room in rooms))


def request_report(report: Report) -> None:
    """Row 3, both modes; inserted after row 2."""
    thread = measure_request("thread")
    proc = measure_request("engine-process")
    thread_modules = thread["api"]["called"]
    api = proc["api"]["called"]
    engine: dict[str, list[str]] = {}
    for e in proc["engines"]:
        for module, functions in e["called"].items():
            engine.setdefault(module, []).extend(functions)
    union = set(api) | set(engine)
    layers = by_layer(thread_modules)
    features = {"thread": in_feature_rooms(thread_modules), "engine_process": in_feature_rooms(union)}
    passes = "Modules one streaming chat request passes (thread mode)"
    rows = [(f"{passes}: `stage5_server`'s own", f"{len(layers['stage5'])}"),
            (f"{passes}: stages 1-4", f"{len(layers['lower'])}"),
            (f"{passes}: `shared/`", f"{len(layers['shared'])}"),
            ("Modules one streaming chat request passes (engine process): API / engine / union",
             f"{len(api)} / {len(engine)} / {len(union)}"),
            ("Feature-room modules one streaming chat request passes (thread mode / engine process)",
             f"{len(features['thread'])} / {len(features['engine_process'])}")]
    at = next(i for i, (label, _) in enumerate(report.rows) if label.startswith("`stage5_server` lines"))
    report.rows[at:at] = rows
    report.data["request_thread_mode_by_layer"] = layers
    report.data["request_feature_room_modules"] = features
    report.numbers.update({"request_modules_thread": len(thread_modules),
                           "request_modules_thread_stage5": len(layers["stage5"]),
                           "request_modules_thread_stages_1_4": len(layers["lower"]),
                           "request_modules_thread_shared": len(layers["shared"]),
                           "request_feature_room_modules_thread": len(features["thread"]),
                           "request_feature_room_modules_engine_process": len(features["engine_process"]),
                           "request_modules_engine_process_api": len(api),
                           "request_modules_engine_process_engine": len(engine),
                           "request_modules_engine_process_union": len(union)})
    report.data["request_thread_mode"] = thread
    report.data["request_engine_process_mode"] = proc

    def listing(title: str, modules: dict[str, list[str]], not_entered: dict[str, list[str]] | None = None) -> None:
        report.details.append(f"{title}: {len(modules)} modules (the functions called in the window)")
        for module, functions in sorted(modules.items()):
            names = sorted({f.rpartition(":")[0] for f in functions})
            more = f" +{len(names) - 4} more" if len(names) > 4 else ""
            report.details.append(f"  {module}: {', '.join(names[:4])}{more}")
        if not_entered:
            report.details.append(f"  ran, not entered (not counted): {', '.join(sorted(not_entered))}")

    for result in (thread, proc):
        report.details.append(f"request ({result['mode']}, {result['model']}): window {result['window_s']} s, "
                              f"measured reply {result['measured']['text']!r} ({result['measured']['finish_reason']})")
        for e in result["engines"]:
            if e["untraced_threads"]:
                report.details.append(f"  engine pid {e['pid']}: threads started before the tracer, not traced: "
                                      f"{e['untraced_threads']}")
    listing("thread mode (API and engine core, one process)", thread_modules, thread["api"]["ran_not_entered"])
    listing("engine-process mode, API process", api, proc["api"]["ran_not_entered"])
    listing("engine-process mode, engine-core process", engine,
            {m: f for e in proc["engines"] for m, f in e["ran_not_entered"].items() if m not in engine})
    report.details.append(f"engine-process mode, union: {len(union)} modules; in both processes: "
                          f"{', '.join(sorted(set(api) & set(engine))) or 'none'}")
    report.details.append(f"in thread mode only: {', '.join(sorted(set(thread_modules) - union)) or 'none'}")
    report.details.append(f"in engine-process mode only: {', '.join(sorted(union - set(thread_modules))) or 'none'}")


def git_commit(root: Path = REPO) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def markdown(report: Report, column: str) -> str:
    width = max(len(label) for label, _ in report.rows)
    lines = [f"| {'measure'.ljust(width)} | {column} |", f"|{'-' * (width + 2)}|{'-' * (len(column) + 1)}:|"]
    lines += [f"| {label.ljust(width)} | {value.rjust(len(column))} |" for label, value in report.rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the numbers (and the lists behind them) here")
    parser.add_argument("--verbose", "-v", action="store_true", help="the lists behind each number")
    parser.add_argument("--static-only", action="store_true", help="skip row 3 (no server is started)")
    parser.add_argument("--trace-request", choices=("thread", "engine-process"), help=argparse.SUPPRESS)
    parser.add_argument("--trace-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trace_request:  # the process measure_request starts
        _serve_and_trace(args.trace_request, args.trace_out)
        return 0

    began = time.monotonic()
    report = static_report()
    if not args.static_only:
        request_report(report)
    elapsed = time.monotonic() - began
    commit = git_commit()
    print(markdown(report, f"this checkout ({commit})" if commit else "this checkout"))
    print(f"\n(measured in {elapsed:.0f} s; `python scripts/layering_report.py{' --static-only' * args.static_only}`)")
    if args.verbose:
        print("\n" + "\n".join(report.details))
    if args.json:
        args.json.write_text(json.dumps({"commit": commit, "elapsed_s": round(elapsed, 1),
                                         "rows": dict(report.rows), "numbers": report.numbers, **report.data},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [p for p in (str(REPO), str(SCRIPTS)) if p not in sys.path]
    sys.exit(main())
