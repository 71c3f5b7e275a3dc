"""Faults injected into an engine core wherever it runs: this process, or an engine-core process of its own.

An engine plugin (``STAGEDSERVE_ENGINE_PLUGINS=tests.reliability.engine_faults:install``, see
``stage5_server/core/plugins.py``) or a direct ``install(llm)`` wraps the model runner's
forward pass. A test steers it through files in a directory (``EngineFaults``), so it can act at
the moment it chooses even when the engine core is another process:

- ``step_delay``: sleep this many seconds before each forward pass (a slow model, on any machine);
- ``fail_next_step``: the next forward pass raises; the first engine core to claim the file fails,
  so exactly one step fails however many ranks run;
- ``hold.<pid>``: the engine core in process ``pid`` runs only so many more steps, then each step
  waits before its forward pass (before it could claim a failure) until the test lets it go. The
  core publishes what a step changed when the step ends, so a held core's /metrics stand still.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.stage5.server_fixtures import engine_runner

FAULTS_DIR_ENV = "STAGEDSERVE_FAULTS_DIR"
PLUGIN = "tests.reliability.engine_faults:install"


class EngineFaults:
    """The test's side: the directory the engine cores watch, and what it can ask of them."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def env(self) -> dict[str, str]:
        """For a process that starts engine cores: load the plugin there, watching this directory."""
        return {"STAGEDSERVE_ENGINE_PLUGINS": PLUGIN, FAULTS_DIR_ENV: str(self.directory)}

    def slow_steps(self, seconds: float) -> None:
        (self.directory / "step_delay").write_text(str(seconds))

    def fail_next_step(self) -> None:
        (self.directory / "fail_next_step").touch()

    def failed_steps(self) -> int:
        return len(list(self.directory.glob("fail_next_step.*")))

    def hold_steps(self, pid: int, after: int = 0) -> None:
        """Let the engine core in process ``pid`` run ``after`` more steps (counted from now), then hold it."""
        order = self.directory / f"hold.{pid}"
        draft = order.with_name(f"{order.name}.draft")
        draft.write_text(f"{after} {time.monotonic_ns()}")  # a new order, even with the same count
        os.replace(draft, order)  # the engine core never reads half of it

    def release_steps(self) -> None:
        """Let every held engine core go on."""
        for order in self.directory.glob("hold.*"):
            order.unlink(missing_ok=True)


def install(llm, directory: str | Path | None = None) -> None:
    """Wrap the runner of ``llm`` (an ``LLM`` or an engine core); ``directory`` defaults to
    ``$STAGEDSERVE_FAULTS_DIR``."""
    folder = Path(directory or os.environ[FAULTS_DIR_ENV])
    runner, method = engine_runner(llm)
    execute = getattr(runner, method)
    hold = {"order": None, "steps": 0}  # the newest hold order this core saw, and its steps since

    def wait_while_held():
        path = folder / f"hold.{os.getpid()}"
        while True:
            try:
                order = path.read_text()
            except FileNotFoundError:
                return
            if order != hold["order"]:
                hold["order"], hold["steps"] = order, 0
            if hold["steps"] < int(order.split()[0]):
                hold["steps"] += 1
                return
            time.sleep(0.005)

    def execute_with_faults(*args, **kwargs):
        delay = folder / "step_delay"
        if delay.exists():
            time.sleep(float(delay.read_text() or 0))
        wait_while_held()
        try:  # claim the fault: only one engine core can rename the file
            os.rename(folder / "fail_next_step", folder / f"fail_next_step.{os.getpid()}.{time.monotonic_ns()}")
        except FileNotFoundError:
            return execute(*args, **kwargs)
        raise RuntimeError("injected model failure")

    setattr(runner, method, execute_with_faults)
