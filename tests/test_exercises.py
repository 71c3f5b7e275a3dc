"""The learner copy blanks the right functions, and the stage's tests then hold it to account."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_exercises import EXERCISES, blank_functions, make_copy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_blanking_keeps_signature_and_docstring():
    source = 'class A:\n    def f(self, x):\n        """Doc."""\n        y = x + 1\n        return y\n'
    blanked = blank_functions(source, ["A.f"])
    assert 'def f(self, x):\n        """Doc."""\n        raise NotImplementedError' in blanked
    assert "return y" not in blanked


@pytest.mark.parametrize("stage_number", sorted(EXERCISES))
def test_every_listed_exercise_exists_in_the_reference(stage_number):
    for rel, names in EXERCISES[stage_number].items():
        blanked = blank_functions((ROOT / rel).read_text(), names)
        assert blanked.count("raise NotImplementedError(\"exercise") == len(names)
        compile(blanked, rel, "exec")


@pytest.mark.slow
def test_stage1_tests_fail_on_the_blank_learner_copy(tmp_path):
    copy = make_copy(1, tmp_path)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             "tests/stage1/test_contiguous_kv_cache.py::test_reservations_are_first_fit_and_merge_on_release"],
                            cwd=copy, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "exercise: implement ContiguousKVCache.reserve" in result.stdout
    assert (ROOT / "stage1_naive/kv_cache.py").read_text().count("NotImplementedError") == 0
