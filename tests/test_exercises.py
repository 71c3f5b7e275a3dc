"""The learner's loop: a blank copy fails each task's own tests, goes green task by task, and loses no work.

``scripts/exercise_tasks.py`` lists, per stage, the blanked functions in the order a learner
writes them, and the tests that judge each one. The slow test below walks every stage from a
blank copy to a solved one exactly as a learner would (``make check``, ``make solve`` the task,
check again), so a task whose tests lean on a later task, or do not exercise their own function,
fails here. The others pin the loop around it: a copy made twice keeps the learner's edits, a
test that runs into another task's blank names that task, ``make test STAGE=N`` in a copy runs
what it runs in the project, and a copy never installs into the environment it links.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from exercise_tasks import TASKS  # noqa: E402
from make_exercises import (  # noqa: E402
    ATTEMPTS,
    EXERCISES,
    MARKER,
    CopyHoldsWork,
    PytestRunner,
    blank_functions,
    make_copy,
    markdown,
    reference_source,
    restore_function,
    snippet_path,
    task_reports,
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


@pytest.mark.parametrize("stage_number", sorted(TASKS))
def test_each_stage_has_a_task_of_several_functions_and_every_task_three_hints_and_a_time(stage_number):
    tasks = TASKS[stage_number]
    assert any(len(t.functions) > 1 for t in tasks), f"stage {stage_number}: no task asks for several functions"
    for t in tasks:
        assert len(t.hints) == 3 and all(h.strip() for h in t.hints), f"{t.name}: the idea, the API, nearly the answer"
        assert 0 < t.minutes <= 90, t.name


@pytest.mark.parametrize("stage_number", sorted(TASKS))
def test_the_stage_page_shows_no_answer_only_the_command_that_prints_it(stage_number):
    page = "\n".join(line.strip() for line in markdown(stage_number).splitlines())
    for t in TASKS[stage_number]:
        code = [line.strip() for line in reference_source(t).splitlines() if line.strip()]
        windows = ["\n".join(code[i:i + 3]) for i in range(len(code) - 2)]  # any three lines in a row
        assert not [w for w in windows if w in page], f"{t.name}: the reference is on the page"
        assert f"make peek STAGE={stage_number} TASK={t.name}" in page


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


def make(copy: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``make ARGS`` in a learner's copy, as the learner types it."""
    return subprocess.run(["make", "--no-print-directory", *args], cwd=copy, capture_output=True, text=True,
                          timeout=timeout)


def test_making_a_copy_again_keeps_the_learners_edits(tmp_path):
    copy = make_copy(1, tmp_path)
    kv_cache = copy / "stage1_naive" / "kv_cache.py"
    blank = kv_cache.read_text()
    make_copy(1, tmp_path)  # nothing edited yet: made again, silently
    edited = blank.replace('raise NotImplementedError("exercise: implement ContiguousKVCache.reserve")',
                           "return None  # my first try")
    kv_cache.write_text(edited)
    (copy / "notes.txt").write_text("what I learnt\n")
    with pytest.raises(CopyHoldsWork) as refused:
        make_copy(1, tmp_path)
    message = str(refused.value)
    assert "stage1_naive/kv_cache.py" in message and "notes.txt" in message and "FRESH=1" in message
    assert kv_cache.read_text() == edited and (copy / "notes.txt").is_file()  # nothing was written
    make_copy(1, tmp_path, fresh=True)  # start over: the old copy is kept aside, whole
    backup = tmp_path / "stage1.backup-1"
    assert (backup / "stage1_naive" / "kv_cache.py").read_text() == edited
    assert (backup / "notes.txt").read_text() == "what I learnt\n"
    assert kv_cache.read_text() == blank and not (copy / "notes.txt").exists()


def test_a_folder_that_is_not_a_learner_copy_is_never_overwritten(tmp_path):
    (tmp_path / "stage2").mkdir()
    (tmp_path / "stage2" / "thesis.tex").write_text("months of work\n")
    with pytest.raises(CopyHoldsWork, match="not a learner copy"):
        make_copy(2, tmp_path, fresh=True)
    assert sorted(p.name for p in (tmp_path / "stage2").iterdir()) == ["thesis.tex"]


def test_solve_puts_the_reference_in_and_keeps_the_learners_attempt(tmp_path):
    copy = make_copy(4, tmp_path)
    item = max(TASKS[4], key=lambda t: len(t.functions))  # a task of several functions
    path = copy / item.file
    restore_function(copy, item)  # from the blank: nothing to keep
    assert not (copy / ATTEMPTS).exists()
    assert path.read_text() == (ROOT / item.file).read_text()
    make_copy(4, tmp_path, fresh=True)
    first = item.functions[0].split(".")[-1]
    attempt = path.read_text().replace(f'raise NotImplementedError("exercise: implement {item.functions[0]}")',
                                       "return 'my attempt'", 1)
    path.write_text(attempt)
    saved = restore_function(copy, item)
    assert path.read_text() == (ROOT / item.file).read_text()
    assert saved == copy / ATTEMPTS / f"{item.name}.py"
    assert f"def {first}" in saved.read_text() and "return 'my attempt'" in saved.read_text()


def test_a_copy_never_installs_into_the_environment_it_links(tmp_path):
    copy = make_copy(1, tmp_path)
    assert (copy / ".venv").is_symlink() and (copy / ".venv").resolve() == (ROOT / ".venv").resolve()
    (copy / "pyproject.toml").touch()  # newer than the linked environment's install stamps
    planned = make(copy, "-n", "test", "exercises", "check")
    assert planned.returncode == 0, planned.stderr
    assert "pip install" not in planned.stdout and "-m venv" not in planned.stdout, planned.stdout
    (copy / MARKER).unlink()  # even a copy that lost its marker: the link alone says "borrowed"
    planned = make(copy, "-n", "test")
    assert planned.returncode == 0 and "pip install" not in planned.stdout, planned.stdout


def test_a_copy_made_where_no_environment_is_set_up_links_none(tmp_path):
    # A fresh clone before its first make: the copy must not borrow another checkout's .venv.
    clone = tmp_path / "clone"
    for rel in working_tree_files(ROOT):
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        (clone / rel).write_bytes((ROOT / rel).read_bytes())
    copy = make_copy(2, tmp_path / "out", root=clone)
    assert not (copy / ".venv").exists() and not (copy / ".venv").is_symlink()
    answer = make(copy, "check")
    assert answer.returncode != 0 and "no .venv here" in answer.stdout + answer.stderr


def test_check_names_the_task_whose_blank_another_task_ran_into(tmp_path):
    copy = make_copy(3, tmp_path)
    answer = make(copy, "check", "TASK=update_from_output preempt")
    out = answer.stdout
    assert answer.returncode != 0, out + answer.stderr
    total = len(TASKS[3])
    assert f"task 1/{total} update_from_output" in out and "preempt" in out  # both tasks, in one check
    assert "blocked by task 2, schedule: make solve TASK=schedule" in out
    assert "next: update_from_output" in out.replace("Scheduler.", "")
    assert make(copy, "solve", "TASK=update_from_output schedule").returncode == 0
    out = make(copy, "check", "TASK=preempt").stdout
    assert "blocked by" not in out and "exercise: implement Scheduler._preempt" in out, out
    assert "next: Scheduler._preempt" in out


@pytest.mark.slow
def test_make_test_stage_in_a_copy_collects_what_it_collects_in_the_project(tmp_path):
    # The copy sits in folders whose names hold other stages (and its own, stage2): only the
    # test's path inside the repository decides which stage it belongs to.
    copy = make_copy(2, tmp_path / "stage3")
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            "--stage", "2"]

    def collected(where: Path) -> set[str]:
        done = subprocess.run(args, cwd=where, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(where)})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return {line for line in done.stdout.splitlines() if "::" in line}

    in_project = collected(ROOT)
    assert in_project and all(n.startswith(("tests/stage2/", "tests/invariants/")) for n in in_project)
    assert collected(copy) == in_project


@pytest.mark.slow
@pytest.mark.parametrize("stage_number", sorted(TASKS))
def test_a_blank_copy_goes_green_one_task_at_a_time(stage_number, tmp_path):
    copy = make_copy(stage_number, tmp_path)
    tasks = TASKS[stage_number]
    # Step k: tasks before k are solved (with make solve), k and later are blank. Task k-1 must
    # pass (its tests do not lean on later tasks) and every test of task k must fail, on its own
    # functions' blanks: no task is blocked by another's.
    with PytestRunner(copy) as runner:  # one pytest process for every step
        for k in range(len(tasks) + 1):
            previous, current = tasks[k - 1] if k else None, tasks[k] if k < len(tasks) else None
            names = [t.name for t in (previous, current) if t]
            reports = {r.task.name: r for r in task_reports(copy, stage_number, names, runner=runner)}
            if previous:
                report = reports[previous.name]
                assert report.passing, (
                    f"{previous.name} should pass once solved, with the tasks after it still blank: {report.results}")
            if current:
                report = reports[current.name]
                assert report.results and all(r.message is not None for r in report.results), (
                    f"every test of {current.name} should fail while it is blank: {report.results}")
                assert report.blocked_by == [], f"{current.name} is blocked by {[t.name for t in report.blocked_by]}"
                assert any(set(r.blanks) & set(current.functions) for r in report.results), report.results
                solved = make(copy, "solve", f"TASK={current.name}")  # what a learner who skips it types
                assert solved.returncode == 0, solved.stdout + solved.stderr
    for rel in EXERCISES[stage_number]:
        assert (copy / rel).read_text() == (ROOT / rel).read_text(), f"{rel}: solving every task restores the reference"
    assert (ROOT / "stage1_naive/kv_cache.py").read_text().count("NotImplementedError") == 0
