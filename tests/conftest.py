"""Shared fixtures: tiny checkpoints built once, and the list of stages under test.

``pytest --stage N`` (or ``make test STAGE=N``) runs the invariant suite against stage N
only, plus ``tests/stageN/``. A new stage joins the invariant suite by adding one line
to ``STAGES``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run in its interpreter; Triton reads this when a kernel
# module is imported, so it is set before any test imports one.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("STAGEDSERVE_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "stagedserve"))
# Under xdist, share the cores among the workers: with more torch threads than cores, every
# parallel op waits on a descheduled thread (a decode step of the 135M default model ran 9x slower).
# OMP_NUM_THREADS carries the share to every engine a test builds (stage5 would otherwise take
# every physical core) and to the server processes tests start.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@dataclass(frozen=True)
class StageSpec:
    number: int
    package: str
    # Engine arguments the invariant tests use for this stage (small pools, small blocks).
    engine_kwargs: dict = field(default_factory=dict)
    name: str | None = None  # the test id, when one package is under test in two configurations

    @property
    def module(self):
        return importlib.import_module(self.package)

    def make_llm(self, model, **overrides):
        kwargs = {"max_model_len": 256, "max_num_seqs": 8, **self.engine_kwargs, **overrides}
        spec = kwargs.get("speculative_config")
        if spec and spec.get("model") == SELF_DRAFT:  # the model under test drafts for itself
            kwargs["speculative_config"] = {**spec, "model": str(model)}
        llm = self.module.LLM(model=str(model), **kwargs)
        if spec and spec.get("model") == SELF_DRAFT:
            # A draft as costly as the target never pays, so the draft-length policy would stop it
            # drafting; the suite wants every step drafted, so it runs without the policy.
            llm.engine.drafter.policy = None
        return llm

    def __str__(self) -> str:
        return self.name or self.package


SELF_DRAFT = "self"  # in a stage's speculative_config: the checkpoint under test

STAGES = [
    StageSpec(1, "stage1_naive"),
    StageSpec(2, "stage2_paged", {"block_size": 4}),
    StageSpec(3, "stage3_continuous", {"block_size": 4, "max_num_batched_tokens": 16}),
    StageSpec(4, "stage4_prefix_cache", {"block_size": 4, "max_num_batched_tokens": 16}),
    # stage5 on its CPU defaults (the cpu attention backend, the fused model), in float32: the
    # dtype the invariants are stated in ("auto" may be bfloat16 on a CPU with bf16 units).
    StageSpec(5, "stage5_server", {"block_size": 4, "max_num_batched_tokens": 16, "device": "cpu",
                                   "dtype": "float32"}),
    # stage5 with n-gram speculative decoding: every promise holds with drafts verified and rolled back
    # (prompt lookup from one token on, so that drafts are proposed often, and mostly rejected).
    StageSpec(5, "stage5_server", {"block_size": 4, "max_num_batched_tokens": 16, "device": "cpu",
                                   "dtype": "float32", "speculative_config": {
                                       "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 3}}, name="stage5_server-ngram"),
    # stage5 with the model under test as its own draft model: every promise holds with a second model
    # and its KV cache run after each step, through preemption, prefix hits and chunked prefill.
    StageSpec(5, "stage5_server", {"block_size": 4, "max_num_batched_tokens": 16, "device": "cpu",
                                   "dtype": "float32", "speculative_config": {
                                       "method": "draft_model", "model": "self", "num_speculative_tokens": 3}},
              name="stage5_server-draft"),
]


def pytest_configure(config):
    # RELIABILITY_FIGURES=path.json: write the reliability suite's counts there (docs/reliability.md).
    path = os.environ.get("RELIABILITY_FIGURES")
    if path:
        from tests.reliability.figures import FiguresPlugin

        config.pluginmanager.register(FiguresPlugin(path), "reliability-figures")


def pytest_addoption(parser):
    parser.addoption("--stage", action="store", type=int, default=None,
                     help="run the invariant suite against this stage only, plus tests/stageN/")


def selected_stages(config) -> list[StageSpec]:
    wanted = config.getoption("--stage")
    return [s for s in STAGES if wanted is None or s.number == wanted]


def pytest_generate_tests(metafunc):
    if "stage" in metafunc.fixturenames:
        stages = selected_stages(metafunc.config)
        minimum = getattr(metafunc.module, "MIN_STAGE", 1)
        stages = [s for s in stages if s.number >= minimum]
        metafunc.parametrize("stage", stages, ids=str)


def repo_relative_parts(path: Path, root: Path) -> tuple[str, ...]:
    """The parts of a test file's path relative to the repository root (``("tests", "stage2", ...)``).

    Only these say which stage a test belongs to: the folders above the repository (a learner's
    copy lives in ``build/exercises/stage2``) say nothing about it.
    """
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).parts
    except ValueError:
        return ()


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--stage")
    if wanted is None:
        return
    keep, drop = [], []
    for item in items:
        parts = repo_relative_parts(Path(str(item.fspath)), config.rootpath)
        ok = parts[:2] == ("tests", "invariants") or parts[:2] == ("tests", f"stage{wanted}")
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    from course import cached_tiny_model

    return cached_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    from course import cached_tiny_model

    return cached_tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    from course import cached_tiny_model

    return cached_tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_llava() -> Path:
    from course.tiny_llava import cached_tiny_llava

    return cached_tiny_llava()


@pytest.fixture(scope="session")
def checkpoints(tiny_llama, tiny_qwen3, tiny_qwen2) -> dict[str, Path]:
    return {"llama": tiny_llama, "qwen3": tiny_qwen3, "qwen2": tiny_qwen2}
