"""Goodput of two candidates in a 100 s window, with shared.metrics.goodput, and the wrong denominator.

Counts (offered, completed, passed SLO) are the synthetic A/B example of the course text.
Run: .venv/bin/python docs/snippets/goodput_ab.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from shared import goodput  # noqa: E402

WINDOW = 100
for name, (offered, completed, passed) in {"A": (1000, 600, 550), "B": (800, 780, 752)}.items():
    right = goodput(passed, WINDOW)
    wrong = (offered / WINDOW) * (passed / completed)  # pass fraction over completions only
    print(f"{name}: offered {offered}, completed {completed}, passed {passed}")
    print(f"   goodput {passed}/{WINDOW} s = {right:.2f}/s; "
          f"wrong: {offered / WINDOW:.0f}/s x {passed}/{completed} = {wrong:.2f}/s")
