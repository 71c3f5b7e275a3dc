"""The learner's loop: a blank copy fails each task's own tests, and goes green task by task.

``scripts/exercise_tasks.py`` lists, per stage, the blanked functions in the order a learner
writes them, and the tests that judge each one. The slow test below walks every stage from a
blank copy to a solved one exactly as a learner would (``make check``, write a function, check
again), so a task whose tests lean on a later task, or do not exercise their own function, fails
here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from exercise_tasks import TASKS  # noqa: E402
from make_exercises import (  # noqa: E402
    EXERCISES,
    MARKER,
    PytestRunner,
    blank_functions,
    make_copy,
    markdown,
    restore_function,
    run_task_tests,
    snippet_path,
    working_tree_files,
)

ROOT = Path(__file__).resolve().parent.parent


def test_blanking_keeps_signature_and_docstring_and_adds_the_spec():
    source = 'class A:\n    def f(self, x):\n        """Doc."""\n        y = x + 1\n        return y\n'
    blanked = blank_functions(source, ["A.f"], {"A.f": "Spec: return x + 1."})
    assert 'def f(self, x):\n        """Doc.\n\n        Spec: return x + 1.\n        """\n' in blanked
    assert '        raise NotImplementedError("exercise: implement A.f")\n' in blanked
    assert "return y" not in blanked
    compile(blanked, "a.py", "exec")


@pytest.mark.parametrize("stage_number", sorted(EXERCISES))
def test_every_listed_exercise_exists_in_the_reference(stage_number):
    for rel, names in EXERCISES[stage_number].items():
        blanked = blank_functions((ROOT / rel).read_text(), names, {n: "Spec." for n in names})
        assert blanked.count("raise NotImplementedError(\"exercise") == len(names)
        compile(blanked, rel, "exec")


def test_every_task_names_tests_that_exist():
    node_ids = sorted({node for tasks in TASKS.values() for t in tasks for node in t.tests})
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *node_ids], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    for tasks in TASKS.values():
        for t in tasks:
            assert t.tests and t.spec.strip() and t.hints, t.name
    assert len({(stage, t.name) for stage, tasks in TASKS.items() for t in tasks}) == sum(map(len, TASKS.values()))


def test_a_copy_made_inside_the_git_ignored_build_folder_has_every_file(tmp_path):
    # The original failure: the copy was listed with `git ls-files`, which inside build/
    # (ignored by the enclosing repository) lists nothing, so a copy of a copy was empty.
    first = make_copy(1, tmp_path / "one")
    files = set(working_tree_files(first))
    assert {"stage1_naive/kv_cache.py", "Makefile", "tests/conftest.py", "scripts/exercise_tasks.py"} <= files
    assert not any(f.startswith((".venv/", "build/", ".git/")) or f == MARKER for f in files)
    second = make_copy(1, tmp_path / "two", root=first)
    assert (second / "stage1_naive/kv_cache.py").read_text() == (first / "stage1_naive/kv_cache.py").read_text()
    assert (second / ".venv").resolve() == (ROOT / ".venv").resolve()  # the project's environment, linked


def test_the_reference_working_tree_includes_untracked_files_but_not_ignored_ones(tmp_path):
    files = set(working_tree_files(ROOT))
    assert "stage3_continuous/scheduler.py" in files and "scripts/exercise_tasks.py" in files
    assert not any(f.startswith((".venv/", "build/", ".cache/", "site/")) for f in files)


@pytest.mark.parametrize("stage_number", sorted(TASKS))
def test_stage_page_exercises_are_generated_from_the_task_table(stage_number):
    assert snippet_path(stage_number).read_text() == markdown(stage_number), (
        f"run: python scripts/make_exercises.py markdown --stage {stage_number} --write")


@pytest.mark.slow
@pytest.mark.parametrize("stage_number", sorted(TASKS))
def test_a_blank_copy_goes_green_one_task_at_a_time(stage_number, tmp_path):
    copy = make_copy(stage_number, tmp_path)
    tasks = TASKS[stage_number]
    # Step k: tasks before k are solved, k and later are blank. Task k-1 must pass (its tests do
    # not lean on later tasks) and every test of task k must fail, on its own function's stub.
    with PytestRunner(copy) as runner:  # one pytest process for every step
        for k in range(len(tasks) + 1):
            previous, current = tasks[k - 1] if k else None, tasks[k] if k < len(tasks) else None
            results = run_task_tests(copy, [t for t in (previous, current) if t], runner=runner)
            if previous:
                rows = results[previous.name]
                assert rows and all(msg is None for _, msg in rows), (
                    f"{previous.name} should pass once solved, with the tasks after it still blank: {rows}")
            if current:
                rows = results[current.name]
                assert rows and all(msg is not None for _, msg in rows), (
                    f"every test of {current.name} should fail while it is blank: {rows}")
                assert any(f"exercise: implement {current.function}" in msg for _, msg in rows), rows
                restore_function(copy, current)  # the learner writes it (what `solve` does)
    for rel in EXERCISES[stage_number]:
        assert (copy / rel).read_text() == (ROOT / rel).read_text(), f"{rel}: solving every task restores the reference"
    assert (ROOT / "stage1_naive/kv_cache.py").read_text().count("NotImplementedError") == 0
