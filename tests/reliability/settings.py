"""Hypothesis settings for the reliability suite: explicit sizes, so the reported counts are reproducible,
and derandomized under CI (``CI`` set), so CI runs the same examples every time."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

DERANDOMIZE = bool(os.environ.get("CI"))


def machine_settings(max_examples: int, steps: int) -> settings:
    return settings(max_examples=max_examples, stateful_step_count=steps, deadline=None, derandomize=DERANDOMIZE,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
