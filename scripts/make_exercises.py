"""The learner's loop: a copy of the repository with a stage's key functions blanked, checked task by task.

    make exercises STAGE=3             # write build/exercises/stage3, every task of stage 3 blank
    make check STAGE=3                 # each task's own tests: "task 1/3 update_from_output  passing" ...
    make check STAGE=3 TASK=schedule   # one task only
    make hint STAGE=3 TASK=schedule    # the spec and the hints again
    make peek STAGE=3 TASK=schedule    # the reference solution

The same commands work inside the copy (``cd build/exercises/stage3``), which marks itself with
``.exercises.json`` and reuses the project's ``.venv`` through a link, so nothing is installed
twice. Each blanked function keeps its signature; its docstring gains the task's spec (what the
tests pin) and its body becomes ``raise NotImplementedError``. The tasks, their specs, hints and
the pytest node ids that judge each one are in ``scripts/exercise_tasks.py``. The reference in
the repository is never modified.

Under the hood (the commands the targets run):

    python scripts/make_exercises.py build --stage 3 [--out build/exercises]
    python scripts/make_exercises.py check --stage 3 [--task NAME] [--copy DIR | --reference] [-v]
    python scripts/make_exercises.py hint|peek|solve --stage 3 --task NAME
    python scripts/make_exercises.py markdown --stage 3     # the stage page's Exercises section
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exercise_tasks import TASKS, Task, task  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARKER = ".exercises.json"
# Never copied into a learner's copy when the tree is walked without git.
SKIP_DIRS = {".git", ".venv", "build", "site", ".cache", "__pycache__", ".pytest_cache", ".hypothesis",
             ".ipynb_checkpoints", ".ruff_cache"}
SKIP_FILES = {MARKER, ".ci-report-test.xml", ".ci-report-test-slow.xml"}

# stage -> {file: [qualified function names]}, derived from the task table.
EXERCISES: dict[int, dict[str, list[str]]] = {
    stage: {t.file: [u.function for u in tasks if u.file == t.file] for t in tasks} for stage, tasks in TASKS.items()
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
        return sorted(rel for rel in set(listed) if rel and (root / rel).is_file())
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
    """The reference implementation of ``item``'s function, as it stands in ``project``."""
    source = (project / item.file).read_text()
    start, end = _span(_find(source, [item.function])[item.function])
    return "".join(source.splitlines(keepends=True)[start:end])


def restore_function(copy: Path, item: Task, project: Path = ROOT) -> None:
    """Put the reference implementation of ``item`` back into the learner's copy."""
    path = copy / item.file
    source = path.read_text()
    start, end = _span(_find(source, [item.function])[item.function])
    lines = source.splitlines(keepends=True)
    lines[start:end] = reference_source(item, project).splitlines(keepends=True)
    path.write_text("".join(lines))


# ---- the learner's copy ----------------------------------------------------------------------
def spec_docstring(stage: int, item: Task) -> str:
    tasks = TASKS[stage]
    number = tasks.index(item) + 1
    return (f"Exercise: stage {stage}, task {number}/{len(tasks)} ``{item.name}``.\n\n"
            f"{textwrap.dedent(item.spec).strip()}\n\n"
            f"Check: ``make check STAGE={stage} TASK={item.name}``; "
            f"hints: ``make hint STAGE={stage} TASK={item.name}``.")


def project_root(root: Path = ROOT) -> Path:
    """The repository a learner's copy was made from (``root`` itself when it is not a copy)."""
    marker = root / MARKER
    if marker.is_file():
        return Path(json.loads(marker.read_text())["project"])
    return root


def make_copy(stage: int, out: Path, root: Path = ROOT) -> Path:
    """Write ``out/stage<N>``: the working tree of ``root`` with stage N's task functions blanked."""
    if stage not in TASKS:
        raise ValueError(f"stage: choose one of {sorted(TASKS)}, got {stage}")
    project = project_root(root)
    target = out / f"stage{stage}"
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    for rel in working_tree_files(root):
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target / rel)
    for rel, names in EXERCISES[stage].items():
        specs = {t.function: spec_docstring(stage, t) for t in TASKS[stage] if t.file == rel}
        path = target / rel
        path.write_text(blank_functions(path.read_text(), names, specs))
    (target / MARKER).write_text(json.dumps({"stage": stage, "project": str(project),
                                             "tasks": [t.name for t in TASKS[stage]]}, indent=2) + "\n")
    if (project / ".venv").is_dir():  # reuse the project's environment: nothing to install in the copy
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
               "-p", "no:hypothesispytest", "-p", "no:schemathesis", "-o", "junit_family=xunit1"]

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


def run_task_tests(where: Path, tasks: list[Task], verbose: bool = False,
                   runner: PytestRunner | None = None) -> dict[str, list[tuple[str, str | None]]]:
    """Run the tests of ``tasks`` once in ``where``; per task, [(test name, failure message or None)].

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
            outcomes[_case_key(case)] = None if problem is None else (problem.get("message") or problem.tag)
    if returncode not in (0, 1) or not outcomes:  # collection failed, or pytest itself did
        sys.stdout.write(stdout or "")
        raise SystemExit(f"pytest could not run the tests (exit {returncode}) in {where}")
    results = {}
    for t in tasks:
        rows = [(name, msg) for (classname, name), msg in outcomes.items()
                if any(_node_matches(node, classname, name) for node in t.tests)]
        results[t.name] = rows
    return results


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "failed"
    return line if len(line) <= 110 else line[:107] + "..."


def check(where: Path, stage: int, names: list[str] | None = None, verbose: bool = False) -> int:
    """Run the tests of each task (all, or ``names``) in ``where`` and print the progress."""
    tasks = TASKS[stage] if not names else [task(stage, n) for n in names]
    results = run_task_tests(where, tasks, verbose)
    passing = 0
    print(f"stage {stage} exercises in {where}")
    for t in tasks:
        number = TASKS[stage].index(t) + 1
        rows = results[t.name]
        failing = [(n, m) for n, m in rows if m is not None]
        if rows and not failing:
            passing += 1
            print(f"  task {number}/{len(TASKS[stage])} {t.name:<22} passing ({len(rows)} tests)")
        else:
            print(f"  task {number}/{len(TASKS[stage])} {t.name:<22} FAILING ({len(failing)} of {len(rows)} tests)")
            for name, message in failing[:3]:
                print(f"      {name}: {_first_line(message)}")
    print(f"{passing}/{len(tasks)} tasks passing")
    upcoming = [t for t in tasks if results[t.name] and any(m is not None for _, m in results[t.name])]
    if upcoming:
        print(f"next: {upcoming[0].function} in {upcoming[0].file}; "
              f"make hint STAGE={stage} TASK={upcoming[0].name}")
    elif not names:
        print(f"every task passes; the whole suite for this stage: make test STAGE={stage}")
    return 0 if passing == len(tasks) else 1


def learner_copy(stage: int | None, copy: Path | None) -> tuple[Path, int]:
    """Where to check: ``--copy``, this tree if it is a copy, or the default copy under build/."""
    where = copy or (ROOT if (ROOT / MARKER).is_file() else None)
    if where is None:
        if stage is None:
            raise SystemExit("stage: give --stage (make check STAGE=N)")
        where = ROOT / "build" / "exercises" / f"stage{stage}"
    marker = where / MARKER
    if not marker.is_file():
        raise SystemExit(f"no learner copy at {where}: run `make exercises STAGE={stage}` first")
    copied = json.loads(marker.read_text())["stage"]
    if stage is not None and stage != copied:
        raise SystemExit(f"stage: {where} is the learner copy of stage {copied}, not {stage}")
    return where, copied


# ---- the stage page's Exercises section -------------------------------------------------------
def markdown(stage: int) -> str:
    """The Exercises section of ``docs/stageN.md`` (included from ``docs/snippets/exercises_stageN.md``)."""
    tasks = TASKS[stage]
    out = [f"<!-- Written by: python scripts/make_exercises.py markdown --stage {stage} -->",
           "",
           f"Write a learner's copy with stage {stage}'s key functions blanked, then bring it back to green "
           "one task at a time. Each blanked function keeps its signature and gains a docstring that says "
           "what its tests pin; `make check` runs only each task's own tests, with the project's `.venv`.",
           "",
           "```bash",
           f"make exercises STAGE={stage}                 # writes build/exercises/stage{stage}",
           f"cd build/exercises/stage{stage}",
           f"make check                  # every task: \"task 1/{len(tasks)} {tasks[0].name}  FAILING ...\"",
           f"make check TASK={tasks[0].name}",
           f"make hint TASK={tasks[0].name}     # the spec and hints again; make peek TASK=... shows the answer",
           "```",
           "",
           "Tasks go in order: each task's tests use only the tasks before it.",
           ""]
    for number, t in enumerate(tasks, 1):
        spec = textwrap.dedent(t.spec).strip()
        out += [f"#### Task {number}: {t.name}", "",
                f"Write `{t.function}` in `{t.file}`. Check: `make check STAGE={stage} TASK={t.name}` "
                f"({len(t.tests)} test{'s' if len(t.tests) > 1 else ''}).", "",
                spec, ""]
        for i, hint in enumerate(t.hints, 1):
            out += [f'??? tip "Hint {i}"', "", textwrap.indent(hint, "    "), ""]
        answer = textwrap.dedent(reference_source(t)).rstrip()
        out += ['??? success "Answer"', "", "    ```python", textwrap.indent(answer, "    "), "    ```", ""]
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
            p.add_argument("--out", type=Path, default=ROOT / "build" / "exercises")
        if name in ("check", "solve"):
            p.add_argument("--copy", type=Path, default=None, help="the learner copy (default: this tree "
                           "if it is one, else build/exercises/stageN)")
        if name == "check":
            p.add_argument("--reference", action="store_true", help="check the reference solution instead")
            p.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")
        if name in ("check", "hint", "peek", "solve"):
            p.add_argument("--task", action="append", default=None, help="a task name (repeatable)")
        if name == "markdown":
            p.add_argument("--write", action="store_true", help="write docs/snippets/exercises_stageN.md")
    args = parser.parse_args(argv)

    if args.command == "build":
        stage = args.stage or 1
        target = make_copy(stage, args.out)
        print(f"learner copy for stage {stage}: {target}")
        for number, t in enumerate(TASKS[stage], 1):
            print(f"  task {number}/{len(TASKS[stage])} {t.name}: {t.function} in {t.file}")
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
        return max(check(project_root(), s, args.task, args.verbose) for s in ([args.stage] if args.stage else TASKS))
    if args.command in ("check", "solve"):
        where, stage = learner_copy(args.stage, args.copy)
    else:
        stage = args.stage or (json.loads((ROOT / MARKER).read_text())["stage"] if (ROOT / MARKER).is_file() else None)
        if stage is None:
            raise SystemExit("stage: give --stage (make hint STAGE=N TASK=name)")
    if args.command == "check":
        return check(where, stage, args.task, args.verbose)
    if not args.task:
        raise SystemExit(f"task: give one of {[t.name for t in TASKS[stage]]} (TASK=name)")
    for name in args.task:
        t = task(stage, name)
        if args.command == "hint":
            print(spec_docstring(stage, t))
            for i, hint in enumerate(t.hints, 1):
                print(f"\nhint {i}: {hint}")
            print("\ntests:\n  " + "\n  ".join(t.tests))
        elif args.command == "peek":
            print(f"# the reference {t.function}, from {t.file}\n")
            print(textwrap.dedent(reference_source(t, project_root())))
        else:
            restore_function(where, t, project_root(where))
            print(f"restored the reference {t.function} in {where / t.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
