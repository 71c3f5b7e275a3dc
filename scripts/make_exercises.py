"""The learner's loop: a copy of the repository with a stage's key functions blanked, checked task by task.

    make exercises STAGE=3 [OUT=dir]   # write build/exercises/stage3 (or dir/stage3), every task blank
    make check STAGE=3                 # each task's own tests: "task 1/4 update_from_output  passing" ...
    make check STAGE=3 TASK="schedule preempt"   # only these tasks
    make hint STAGE=3 TASK=schedule [HINT=2]     # the contract and the first hint (or the first two)
    make peek STAGE=3 TASK=schedule    # the reference solution
    make solve STAGE=3 TASK=schedule   # put the reference into the copy, to skip the task

The same commands work inside the copy (``cd build/exercises/stage3``), which marks itself with
``.exercises.json`` and reuses the project's ``.venv`` through a link, so nothing is installed
twice (and nothing is ever installed into that link). Each blanked function keeps its
signature; its docstring gains the task's contract and its body becomes
``raise NotImplementedError``. The tasks, their contracts, hints and the pytest node ids that
judge each one are in ``scripts/exercise_tasks.py``. The reference in the repository is never
modified.

A copy keeps the learner's work: making it again refuses while any file in it differs from
what was written (``FRESH=1`` moves the old copy aside to ``stageN.backup-K`` first), and
``solve`` saves an attempt it replaces in ``.exercises-attempts/``. A task whose tests fail in
another task's blank is reported as blocked by that task, with the command that unblocks it.

Under the hood (the commands the targets run):

    python scripts/make_exercises.py build --stage 3 [--out build/exercises] [--fresh]
    python scripts/make_exercises.py check --stage 3 [--task NAME] [--copy DIR | --reference] [-v]
    python scripts/make_exercises.py hint|peek|solve --stage 3 --task NAME [--hint 2]
    python scripts/make_exercises.py markdown --stage 3     # the stage page's Exercises section

tiny-llm keeps its reference apart in the same way (``src/tiny_llm_ref`` beside the learner's
``src/tiny_llm``), and its ``scripts/dev-tools.py copy-test`` refuses to overwrite a learner's
changed file without ``--force``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exercise_tasks import TASKS, Task, task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARKER = ".exercises.json"
ATTEMPTS = ".exercises-attempts"  # where ``solve`` keeps a learner's attempt that it replaces
# Never copied into a learner's copy when the tree is walked without git.
SKIP_DIRS = {".git", ".venv", "build", "site", ".cache", "__pycache__", ".pytest_cache", ".hypothesis",
             ".ipynb_checkpoints", ".ruff_cache"}
SKIP_FILES = {MARKER, ".ci-report-test.xml", ".ci-report-test-slow.xml"}
HINT_KINDS = ("the idea", "the API", "nearly the answer")

# stage -> {file: [qualified function names]}, derived from the task table.
EXERCISES: dict[int, dict[str, list[str]]] = {
    stage: {t.file: [f for u in tasks if u.file == t.file for f in u.functions] for t in tasks}
    for stage, tasks in TASKS.items()
}


# ---- which files make up the working tree ---------------------------------------------------
def working_tree_files(root: Path) -> list[str]:
    """Paths (relative to ``root``) of the working tree: tracked and untracked-but-not-ignored files.

    In the repository's own checkout git says which files those are (``.gitignore`` applies). A
    tree that is not its own git checkout (a learner's copy, or an unpacked archive) is walked
    instead, skipping environments, caches and build outputs; asking git there would answer for
    the enclosing repository, which ignores ``build/`` and so lists nothing.
    """
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve():
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=root, capture_output=True, text=True, check=True).stdout.split("\0")
        return sorted(rel for rel in set(listed) if rel and rel != MARKER and (root / rel).is_file())
    files = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in filenames:
            path = Path(directory) / name
            if name not in SKIP_FILES and not name.endswith((".pyc", ".tmp")) and not path.is_symlink():
                files.append(path.relative_to(root).as_posix())
    return sorted(files)


# ---- blanking and restoring functions --------------------------------------------------------
def _functions(tree: ast.Module):
    """Yield (qualified name, node) for top-level functions and methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _find(source: str, names: list[str]) -> dict[str, ast.FunctionDef]:
    found = {name: node for name, node in _functions(ast.parse(source)) if name in names}
    missing = sorted(set(names) - set(found))
    if missing:
        raise ValueError(f"exercise functions not found: {missing}")
    return found


def _docstring_node(node: ast.FunctionDef) -> ast.Expr | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def _docstring_lines(text: str, indent: str) -> list[str]:
    if '"""' in text or "\\" in text:
        raise ValueError("docstring: a spec may not contain triple quotes or backslashes")
    body = textwrap.indent(text, indent).rstrip() + "\n"
    lines = body.splitlines(keepends=True)
    lines[0] = f'{indent}"""{lines[0].lstrip()}'
    return [*lines, f'{indent}"""\n'] if len(lines) > 1 else [lines[0].rstrip("\n") + '"""\n']


def blank_functions(source: str, names: list[str], specs: dict[str, str] | None = None) -> str:
    """Replace the bodies of ``names`` with ``raise NotImplementedError``, keeping signatures.

    Each function keeps its docstring; where ``specs`` has text for it, that text is appended to
    the docstring (or becomes the docstring).
    """
    specs = specs or {}
    found = _find(source, names)
    lines = source.splitlines(keepends=True)
    for name, node in sorted(found.items(), key=lambda item: -item[1].lineno):  # bottom-up: line numbers hold
        indent = " " * node.body[0].col_offset
        doc = _docstring_node(node)
        original = ast.get_docstring(node) if doc is not None else None
        spec = specs.get(name, "").strip()
        if original and spec and spec in original:  # blanking a learner's copy again
            spec = ""
        text = "\n\n".join(part for part in (original, spec) if part)
        stub = [f'{indent}raise NotImplementedError("exercise: implement {name}")\n']
        start = (doc or node.body[0]).lineno - 1
        lines[start:node.end_lineno] = (_docstring_lines(text, indent) if text else []) + stub
    return "".join(lines)


def _span(node: ast.FunctionDef) -> tuple[int, int]:
    """0-based [start, end) line span of a function, decorators included."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return first - 1, node.end_lineno


def reference_source(item: Task, project: Path = ROOT) -> str:
    """The reference implementation of ``item``'s functions, as they stand in ``project``."""
    source = (project / item.file).read_text()
    found = _find(source, list(item.functions))
    lines = source.splitlines(keepends=True)
    parts = []
    for name in item.functions:
        start, end = _span(found[name])
        parts.append("".join(lines[start:end]))
    return "\n".join(parts)


def _is_stub(node: ast.FunctionDef, name: str) -> bool:
    """True when the function is still the blank the copy was made with (a docstring and the raise)."""
    body = node.body[1:] if _docstring_node(node) is not None else node.body
    return (len(body) == 1 and isinstance(body[0], ast.Raise)
            and f"exercise: implement {name}" in ast.unparse(body[0]))


def restore_function(copy: Path, item: Task, project: Path = ROOT) -> Path | None:
    """Put the reference implementation of ``item``'s functions back into the learner's copy.

    A function the learner had started (anything but the blank) is saved first, in
    ``.exercises-attempts/<task>.py``; its path is returned (None when nothing was saved).
    """
    path = copy / item.file
    source = path.read_text()
    reference = _find((project / item.file).read_text(), list(item.functions))
    reference_lines = (project / item.file).read_text().splitlines(keepends=True)
    found = _find(source, list(item.functions))
    lines = source.splitlines(keepends=True)
    attempts = []
    for name, node in sorted(found.items(), key=lambda kv: -kv[1].lineno):  # bottom-up: line numbers hold
        start, end = _span(node)
        ref_start, ref_end = _span(reference[name])
        if not _is_stub(node, name) and lines[start:end] != reference_lines[ref_start:ref_end]:
            attempts.append("".join(lines[start:end]))
        lines[start:end] = reference_lines[ref_start:ref_end]
    saved = None
    if attempts:
        saved = copy / ATTEMPTS / f"{item.name}.py"
        saved.parent.mkdir(exist_ok=True)
        header = f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: your {', '.join(item.functions)} from {item.file}\n"
        with saved.open("a") as f:
            f.write(header + "\n".join(textwrap.dedent(a) for a in reversed(attempts)) + "\n")
    path.write_text("".join(lines))
    return saved


# ---- the learner's copy ----------------------------------------------------------------------
def spec_docstring(stage: int, item: Task) -> str:
    tasks = TASKS[stage]
    number = tasks.index(item) + 1
    together = (f" (this task is {len(item.functions)} functions: {', '.join(f'``{f}``' for f in item.functions)})"
                if len(item.functions) > 1 else "")
    return (f"Exercise: stage {stage}, task {number}/{len(tasks)} ``{item.name}``{together}, "
            f"about {item.minutes} minutes.\n\n"
            f"{textwrap.dedent(item.spec).strip()}\n\n"
            f"Check: ``make check STAGE={stage} TASK={item.name}``; "
            f"hints, one at a time: ``make hint STAGE={stage} TASK={item.name} HINT=1``.")


def project_root(root: Path = ROOT) -> Path:
    """The repository a learner's copy was made from (``root`` itself when it is not a copy)."""
    marker = root / MARKER
    if marker.is_file():
        return Path(json.loads(marker.read_text())["project"])
    return root


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edited_files(copy: Path) -> list[str]:
    """Files of a learner's copy that differ from what ``make_copy`` wrote: changed, added or deleted."""
    written = json.loads((copy / MARKER).read_text()).get("files")
    if written is None:  # a copy made before copies recorded their files: assume it holds work
        return ["(every file: this copy does not record what it was made with)"]
    now = set(working_tree_files(copy))
    changed = [rel for rel in sorted(now) if rel not in written or _digest(copy / rel) != written[rel]]
    return changed + [rel for rel in sorted(written) if rel not in now]


class CopyHoldsWork(SystemExit):
    """Making a copy again would overwrite the learner's work: nothing was changed."""


def _backup_path(target: Path) -> Path:
    k = 1
    while (target.parent / f"{target.name}.backup-{k}").exists():
        k += 1
    return target.parent / f"{target.name}.backup-{k}"


def make_copy(stage: int, out: Path, root: Path = ROOT, fresh: bool = False) -> Path:
    """Write ``out/stage<N>``: the working tree of ``root`` with stage N's task functions blanked.

    An existing copy there is replaced only if it holds no work (every file as it was written);
    otherwise this raises ``CopyHoldsWork`` and changes nothing, unless ``fresh``, which first
    moves the old copy to ``out/stage<N>.backup-K``. A folder there that is not a learner's copy
    is never touched.
    """
    if stage not in TASKS:
        raise ValueError(f"stage: choose one of {sorted(TASKS)}, got {stage}")
    project = project_root(root)
    target = out / f"stage{stage}"
    if target.is_symlink() or target.is_file() or (target.is_dir() and not (target / MARKER).is_file()
                                                    and any(target.iterdir())):
        raise CopyHoldsWork(f"{target} exists and is not a learner copy: nothing was written. "
                            f"Choose another folder: make exercises STAGE={stage} OUT=dir")
    if (target / MARKER).is_file():
        edits = edited_files(target)
        default_out = (project / "build" / "exercises").resolve() == Path(out).resolve()
        again = f"make exercises STAGE={stage}{'' if default_out else f' OUT={out}'} FRESH=1"
        if edits and not fresh:
            shown = "\n  ".join(edits[:8]) + (f"\n  ... and {len(edits) - 8} more" if len(edits) > 8 else "")
            raise CopyHoldsWork(
                f"{target} holds your work ({len(edits)} file(s) changed since it was made):\n  {shown}\n"
                f"Nothing was written. To go on with it: cd {target} && make check\n"
                f"To start over, keeping it as {_backup_path(target).name}: {again}")
        if edits:
            target.rename(_backup_path(target))
        else:
            shutil.rmtree(target)  # exactly what was written: nothing to lose
    for rel in working_tree_files(root):
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target / rel)
    for rel, names in EXERCISES[stage].items():
        specs = {f: spec_docstring(stage, t) for t in TASKS[stage] if t.file == rel for f in t.functions}
        path = target / rel
        path.write_text(blank_functions(path.read_text(), names, specs))
    files = {rel: _digest(target / rel) for rel in working_tree_files(target)}
    (target / MARKER).write_text(json.dumps({"stage": stage, "project": str(project),
                                             "tasks": [t.name for t in TASKS[stage]], "files": files},
                                            indent=2) + "\n")
    if (project / ".venv").is_dir():  # reuse the project's environment; the copy's make never installs into it
        (target / ".venv").symlink_to(project / ".venv", target_is_directory=True)
    return target


# ---- checking a copy ---------------------------------------------------------------------------
def _case_key(case: ET.Element) -> tuple[str, str]:
    return case.get("classname", ""), case.get("name", "")


def _node_matches(node_id: str, classname: str, name: str) -> bool:
    path, _, test = node_id.partition("::")
    if classname != path.removesuffix(".py").replace("/", "."):
        return False
    return name == test or ("[" not in test and name.startswith(test + "["))


# --tb=native: pytest's own traceback styles parse the failing source with ``ast``, and a long-lived
# runner on Python 3.11 can hit CPython's "AST constructor recursion depth mismatch" there.
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--tb=native",
               # The property-test and API-fuzz plugins only slow the start (no task's tests need them).
               "-p", "no:hypothesispytest", "-p", "no:schemathesis", "-o", "junit_family=xunit1",
               # A test's captured output goes into the report too: a server or engine process that hit
               # another task's blank says so there, not in the test's own traceback.
               "-o", "junit_logging=all"]
BLANK = re.compile(r"exercise: implement ([\w.]+)")

# A pytest that stays up and runs one batch of tests per line of JSON it reads, forgetting the
# project's modules in between, so a batch sees the copy's files as they are now. It pays for
# importing torch and transformers once instead of once a batch (tests/test_exercises.py walks
# a copy through many states).
_RUNNER = """
import json, sys
import pytest
OWN = ("shared", "stage1_naive", "stage2_paged", "stage3_continuous", "stage4_prefix_cache", "stage5_server",
       "tests", "benchmarks", "conftest")
for line in sys.stdin:
    job = json.loads(line)
    for name in [n for n in sys.modules if n.split(".")[0] in OWN]:
        del sys.modules[name]
    code = pytest.main(job["args"])
    print("\\n@@done " + str(int(code)), flush=True)
"""


def _test_env(where: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(where), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("STAGEDSERVE_CACHE", str(project_root(where) / ".cache" / "stagedserve"))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a learner's edits are read again, never from a stale .pyc
    return env


class PytestRunner:
    """One long-lived pytest process in ``where``: ``run(node_ids, report)`` runs a batch there."""

    def __init__(self, where: Path):
        self.where = where
        self.process = subprocess.Popen([sys.executable, "-c", _RUNNER], cwd=where, env=_test_env(where),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)

    def run(self, node_ids: list[str], report: Path) -> tuple[int, str]:
        job = {"args": [*PYTEST_ARGS, f"--junitxml={report}", *node_ids]}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        output = []
        for line in self.process.stdout:
            if line.startswith("@@done "):
                return int(line.split()[1]), "".join(output)
            output.append(line)
        raise RuntimeError("the test runner exited:\n" + "".join(output[-50:]))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)

    def __enter__(self) -> PytestRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class CaseResult:
    name: str
    message: str | None  # None: passed
    blanks: tuple[str, ...] = ()  # the blanked functions its failure ran into ("Class.method")


def run_task_tests(where: Path, tasks: list[Task], verbose: bool = False,
                   runner: PytestRunner | None = None) -> dict[str, list[CaseResult]]:
    """Run the tests of ``tasks`` once in ``where``; per task, one ``CaseResult`` per test.

    Each call is a fresh pytest process, unless a ``runner`` (a ``PytestRunner`` in ``where``) is given.
    """
    node_ids = sorted({node for t in tasks for node in t.tests})
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        if runner is not None:
            returncode, stdout = runner.run(node_ids, report)
            if verbose:
                sys.stdout.write(stdout)
        else:
            done = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, f"--junitxml={report}", *node_ids],
                                  cwd=where, env=_test_env(where), text=True,
                                  stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT)
            returncode, stdout = done.returncode, done.stdout
        cases = ET.parse(report).getroot().iter("testcase") if report.is_file() else iter(())
        outcomes = {}
        for case in cases:
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is None:
                outcomes[_case_key(case)] = (None, ())
                continue
            text = " ".join(filter(None, [problem.get("message"), problem.text,
                                          *(e.text for e in case if e.tag in ("system-out", "system-err"))]))
            blanks = tuple(dict.fromkeys(BLANK.findall(text)))
            outcomes[_case_key(case)] = (problem.get("message") or problem.tag, blanks)
    if returncode not in (0, 1) or not outcomes:  # collection failed, or pytest itself did
        sys.stdout.write(stdout or "")
        raise SystemExit(f"pytest could not run the tests (exit {returncode}) in {where}")
    results = {}
    for t in tasks:
        results[t.name] = [CaseResult(name, msg, blanks) for (classname, name), (msg, blanks) in outcomes.items()
                           if any(_node_matches(node, classname, name) for node in t.tests)]
    return results


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "failed"
    return line if len(line) <= 110 else line[:107] + "..."


@dataclass
class TaskReport:
    task: Task
    number: int
    results: list[CaseResult]
    blocked_by: list[Task]  # earlier or later tasks whose blank its failing tests ran into

    @property
    def passing(self) -> bool:
        return bool(self.results) and all(r.message is None for r in self.results)


def task_reports(where: Path, stage: int, names: list[str] | None = None, verbose: bool = False,
                 runner: PytestRunner | None = None) -> list[TaskReport]:
    """Run the tests of each task (all, or ``names``) in ``where``: one report per task, in task order."""
    tasks = TASKS[stage] if not names else sorted({task(stage, n) for n in names}, key=TASKS[stage].index)
    results = run_task_tests(where, tasks, verbose, runner)
    owner = {f: t for t in TASKS[stage] for f in t.functions}
    reports = []
    for t in tasks:
        rows = results[t.name]
        named = {owner[b].name: owner[b] for r in rows if r.message is not None for b in r.blanks if b in owner}
        blockers = sorted((b for b in named.values() if b is not t), key=TASKS[stage].index)
        reports.append(TaskReport(t, TASKS[stage].index(t) + 1, rows, blockers))
    return reports


def _command(where: Path, stage: int, target: str, name: str) -> str:
    """The make command that runs ``target`` for task ``name``, as typed where the learner is."""
    inside = (ROOT / MARKER).is_file() and ROOT.resolve() == where.resolve()
    return f"make {target} TASK={name}" if inside else f"make {target} STAGE={stage} TASK={name}"


def check(where: Path, stage: int, names: list[str] | None = None, verbose: bool = False,
          runner: PytestRunner | None = None) -> int:
    """Run the tests of each task (all, or ``names``) in ``where`` and print the progress."""
    reports = task_reports(where, stage, names, verbose, runner)
    total = len(TASKS[stage])
    print(f"stage {stage} exercises in {where}")
    for r in reports:
        label = f"  task {r.number}/{total} {r.task.name:<22}"
        failing = [x for x in r.results if x.message is not None]
        if r.passing:
            print(f"{label} passing ({len(r.results)} tests)")
            continue
        if not r.results:
            print(f"{label} FAILING (none of its tests ran)")
            continue
        print(f"{label} FAILING ({len(failing)} of {len(r.results)} tests)")
        for b in r.blocked_by:
            number = TASKS[stage].index(b) + 1
            print(f"      blocked by task {number}, {b.name}: {_command(where, stage, 'solve', b.name)}"
                  f" (or write it: {_command(where, stage, 'hint', b.name)})")
        for x in failing[:3]:
            print(f"      {x.name}: {_first_line(x.message)}")
    passing = sum(r.passing for r in reports)
    print(f"{passing}/{len(reports)} tasks passing")
    upcoming = next((r for r in reports if not r.passing), None)
    if upcoming is not None:
        first = upcoming.blocked_by[0] if upcoming.blocked_by else upcoming.task
        if first is not upcoming.task:
            print(f"next: task {upcoming.number} waits for task {TASKS[stage].index(first) + 1}, {first.name}; "
                  f"write it ({_command(where, stage, 'hint', first.name)}) or skip it "
                  f"({_command(where, stage, 'solve', first.name)})")
        else:
            print(f"next: {', '.join(first.functions)} in {first.file} (about {first.minutes} min); "
                  f"{_command(where, stage, 'hint', first.name)}")
    elif not names:
        print(f"every task passes; the whole suite for this stage: make test STAGE={stage}")
    return 0 if passing == len(reports) else 1


def learner_copy(stage: int | None, copy: Path | None) -> tuple[Path, int]:
    """Where to check: ``--copy``, this tree if it is a copy, or the default copy under build/."""
    where = copy or (ROOT if (ROOT / MARKER).is_file() else None)
    if where is None:
        if stage is None:
            raise SystemExit("stage: give --stage (make check STAGE=N)")
        where = project_root() / "build" / "exercises" / f"stage{stage}"
    marker = where / MARKER
    if not marker.is_file():
        raise SystemExit(f"no learner copy at {where}: run `make exercises STAGE={stage}` first")
    copied = json.loads(marker.read_text())["stage"]
    if stage is not None and stage != copied:
        raise SystemExit(f"stage: {where} is the learner copy of stage {copied}, not {stage}")
    return where, copied


def task_names(values: list[str] | None) -> list[str] | None:
    """``--task a --task "b c"`` (and ``TASK="b,c"``) -> ``["a", "b", "c"]``."""
    names = [n for v in values or [] for n in re.split(r"[\s,]+", v) if n]
    return names or None


def hint_text(stage: int, t: Task, upto: int) -> str:
    lines = [spec_docstring(stage, t), ""]
    for i, (kind, hint) in enumerate(zip(HINT_KINDS, t.hints), 1):
        if i <= upto:
            lines += [f"hint {i}, {kind}: {hint}", ""]
    if upto < len(t.hints):
        lines += [f"the next hint ({HINT_KINDS[upto]}): make hint TASK={t.name} HINT={upto + 1}", ""]
    else:
        lines += [f"the reference: make peek TASK={t.name}; skip the task: make solve TASK={t.name}", ""]
    lines += ["tests:", *(f"  {node}" for node in t.tests)]
    return "\n".join(lines)


# ---- the stage page's Exercises section -------------------------------------------------------
def markdown(stage: int) -> str:
    """The Exercises section of ``docs/stageN.md`` (included from ``docs/snippets/exercises_stageN.md``)."""
    tasks = TASKS[stage]
    total = sum(t.minutes for t in tasks)
    out = [f"<!-- Written by: python scripts/make_exercises.py markdown --stage {stage} --write -->",
           "",
           f"Write a learner's copy with stage {stage}'s key functions blanked, then bring it back to green "
           f"one task at a time ({len(tasks)} tasks, about {total} minutes in all). Each blanked function keeps "
           "its signature and gains a docstring with the task's contract: what goes in, what comes out, "
           "what must stay true. `make check` runs only each task's own tests, with the project's `.venv`.",
           "",
           "```bash",
           f"make exercises STAGE={stage}        # writes build/exercises/stage{stage} (OUT=dir: dir/stage{stage})",
           f"cd build/exercises/stage{stage}",
           f"make check                # every task: \"task 1/{len(tasks)} {tasks[0].name}  FAILING ...\"",
           f"make check TASK=\"{' '.join(t.name for t in tasks[:2])}\"",
           f"make hint TASK={tasks[0].name}      # the contract and hint 1; HINT=2, HINT=3 for more",
           f"make peek TASK={tasks[0].name}      # the reference; make solve TASK=... puts it in the copy",
           "```",
           "",
           "Tasks go in order: each task's tests use only the tasks before it. A test that runs into "
           "another task's blank says which (`blocked by task 2, ...: make solve TASK=...`). Making the "
           "copy again never overwrites your work: it refuses while any file differs from what it wrote "
           "(`FRESH=1` keeps the old copy as `stageN.backup-1` and starts over), and `make solve` keeps "
           "an attempt it replaces in `.exercises-attempts/`.",
           ""]
    for number, t in enumerate(tasks, 1):
        spec = textwrap.dedent(t.spec).strip()
        what = " and ".join(f"`{f}`" for f in t.functions)
        out += [f"#### Task {number}: {t.name} (about {t.minutes} min)", "",
                f"Write {what} in `{t.file}`. Check: `make check STAGE={stage} TASK={t.name}` "
                f"({len(t.tests)} test{'s' if len(t.tests) > 1 else ''}).", "",
                spec, ""]
        for i, (kind, hint) in enumerate(zip(HINT_KINDS, t.hints), 1):
            out += [f'??? tip "Hint {i}: {kind}"', "", textwrap.indent(hint, "    "), ""]
        out += [f"The reference is not on this page: `make peek STAGE={stage} TASK={t.name}` prints it.", ""]
    return "\n".join(out).rstrip() + "\n"


def snippet_path(stage: int) -> Path:
    return ROOT / "docs" / "snippets" / f"exercises_stage{stage}.md"


# ---- the command line ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("build", "check", "hint", "peek", "solve", "markdown")
    if not argv or argv[0] not in commands and argv[0] not in ("-h", "--help"):
        argv.insert(0, "build")  # the old form: make_exercises.py --stage N
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in commands:
        p = sub.add_parser(name)
        p.add_argument("--stage", type=int, default=None)
        if name == "build":
            p.add_argument("--out", type=Path, default=None,
                           help="the folder the copy goes in, as OUT/stageN (default: the project's build/exercises)")
            p.add_argument("--fresh", action="store_true",
                           help="start over: move a copy that holds work to stageN.backup-K first")
        if name in ("check", "solve"):
            p.add_argument("--copy", type=Path, default=None, help="the learner copy (default: this tree "
                           "if it is one, else build/exercises/stageN)")
        if name == "check":
            p.add_argument("--reference", action="store_true", help="check the reference solution instead")
            p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")
        if name in ("check", "hint", "peek", "solve"):
            p.add_argument("--task", action="append", default=None,
                           help="a task name; repeat it, or give several separated by spaces")
        if name == "hint":
            p.add_argument("--hint", type=int, default=1, help="show hints 1 to this one (1-3)")
        if name == "markdown":
            p.add_argument("--write", action="store_true", help="write docs/snippets/exercises_stageN.md")
    args = parser.parse_args(argv)
    names = task_names(getattr(args, "task", None))

    if args.command == "build":
        stage = args.stage or 1
        out = args.out or project_root() / "build" / "exercises"
        target = make_copy(stage, out.expanduser().resolve(), fresh=args.fresh)
        print(f"learner copy for stage {stage}: {target}")
        for number, t in enumerate(TASKS[stage], 1):
            print(f"  task {number}/{len(TASKS[stage])} {t.name} (about {t.minutes} min): "
                  f"{', '.join(t.functions)} in {t.file}")
        for old in sorted(target.parent.glob(f"{target.name}.backup-*")):
            print(f"an earlier copy, kept: {old}")
        print(f"then: cd {target} && make check")
        return 0
    if args.command == "markdown":
        for stage in [args.stage] if args.stage else sorted(TASKS):
            text = markdown(stage)
            if args.write:
                snippet_path(stage).write_text(text)
            else:
                print(text)
        return 0
    if args.command == "check" and args.reference:
        return max(check(project_root(), s, names, args.verbose) for s in ([args.stage] if args.stage else TASKS))
    if args.command in ("check", "solve"):
        where, stage = learner_copy(args.stage, args.copy)
    else:
        stage = args.stage or (json.loads((ROOT / MARKER).read_text())["stage"] if (ROOT / MARKER).is_file() else None)
        if stage is None:
            raise SystemExit("stage: give --stage (make hint STAGE=N TASK=name)")
    if args.command == "check":
        return check(where, stage, names, args.verbose)
    if not names:
        raise SystemExit(f"task: give one of {[t.name for t in TASKS[stage]]} (TASK=name)")
    for name in names:
        t = task(stage, name)
        if args.command == "hint":
            print(hint_text(stage, t, max(1, min(args.hint, len(t.hints)))))
        elif args.command == "peek":
            print(f"# the reference {', '.join(t.functions)}, from {t.file}\n")
            print(textwrap.dedent(reference_source(t, project_root())))
        else:
            saved = restore_function(where, t, project_root(where))
            print(f"task {name}: the reference {', '.join(t.functions)} is now in {where / t.file}")
            if saved is not None:
                print(f"  your attempt is kept in {saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
