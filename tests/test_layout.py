"""The repository's layering: shared/ imports no stage, no stage imports a later one, and no module of
stage5_server imports itself back through another (every import, at the top or inside a function;
a package's ``__init__`` that re-exports its modules is not counted as importing them back)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["stage1_naive", "stage2_paged", "stage3_continuous", "stage4_prefix_cache", "stage5_server"]


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path, known: dict[str, Path] | None = None) -> set[str]:
    """Every module name ``path`` imports: ``from a.b import c`` is ``a.b.c`` when that is a module of
    ``known``, else ``a.b``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if known and full in known else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def import_cycles(package: str) -> list[list[str]]:
    mods = modules(package)
    graph = {name: sorted(n for n in imported(path, mods) if n in mods and n != name) for name, path in mods.items()}
    cycles, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
    return cycles


def test_stage5_has_no_import_loops():
    assert import_cycles("stage5_server") == []


def test_the_cycle_finder_sees_a_loop(tmp_path, monkeypatch):
    package = tmp_path / "loopy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from loopy.b import g\n")
    (package / "b.py").write_text("from loopy.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_cycles("loopy") == [["loopy.a", "loopy.b", "loopy.a"]]


@pytest.mark.parametrize("index", range(len(STAGES) + 1))
def test_shared_imports_no_stage_and_no_stage_imports_a_later_one(index):
    package = "shared" if index == len(STAGES) else STAGES[index]
    later = STAGES if package == "shared" else STAGES[index + 1:]
    offending = {name: sorted(n for n in imported(path) if n.split(".")[0] in later)
                 for name, path in modules(package).items()}
    assert {name: names for name, names in offending.items() if names} == {}


# The course's material (tiny checkpoints, workloads, the chat tasks: ``course/``) is for tests, benchmarks, scripts
# and notebooks: no engine imports it. Stage 5's two commands that hand it to a user (``make-tiny-model``, ``bench
# serve``'s datasets) import it inside the command; ``shared.named_models`` names the builder of the ``tiny`` and
# ``small`` models by its qualified name.
COURSE_COMMANDS = {"stage5_server.cli.tiny_model", "stage5_server.bench.datasets"}


@pytest.mark.parametrize("package", ["shared", *STAGES])
def test_no_stage_imports_the_course_package(package):
    found = {name: sorted(n for n in imported(path) if n.split(".")[0] == "course")
             for name, path in modules(package).items() if name not in COURSE_COMMANDS}
    assert {name: names for name, names in found.items() if names} == {}


def test_the_commands_that_hand_out_the_course_import_it_inside_the_command():
    mods = modules("stage5_server")
    for name in COURSE_COMMANDS:
        top_level = [node for node in ast.parse(mods[name].read_text()).body
                     if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not [n for n in top_level for alias in getattr(n, "names", [])
                    if (getattr(n, "module", None) or alias.name).split(".")[0] == "course"], name


# ---- the rooms of stage5_server ----------------------------------------------------------------------------------
# Which rooms each room may import, at run time or only for type hints (``if TYPE_CHECKING:``): the chain runs front
# end -> core -> executor -> worker -> model, attention and kernels; a system (speculative decoding, LoRA, pooling,
# images, the KV connector, weight sync) reaches the chain only where it plugs in (a request's fields, the drafter, a
# runner kind or a worker extension named by its qualified name, the linear-layer seam); ``config``, ``errors``,
# ``processes`` and the step contract (``outputs``: what the core hands the workers and what comes back) sit under
# everything.
sys.path.insert(0, str(ROOT / "scripts"))
import layering_report  # noqa: E402

BASE = {"config", "errors", "processes", "arg_types", "outputs"}
MODEL = {"model", "attention", "kernels", "cpu_kernels", "quantization", "parallel"}
ROOM_IMPORTS = {
    "__main__": {"cli"},
    "cli": {"server", "engine", "data_parallel", "core", "bench", "multimodal", "kv_transfer"} | BASE,  # multimodal:
    # make-tiny-model; kv_transfer: disagg-proxy
    "bench": {"server", "llm"} | BASE,
    "demo": {"__init__", "server"} | BASE,
    "__init__": {"llm", "core"} | BASE,  # the rest on first use
    "server": {"engine", "lora", "multimodal", "pooling", "weight_sync"} | BASE,
    "llm": {"engine", "core", "lora", "multimodal", "pooling", "weight_sync"} | BASE,
    "engine": {"core", "data_parallel", "lora", "multimodal", "weight_sync"} | BASE,
    "data_parallel": {"core"} | BASE,
    "pooling": {"core", "worker"} | BASE,  # a runner kind: its scheduler and workers build on the chain's
    "core": {"executor", "attention", "spec_decode", "lora", "multimodal", "weight_sync", "kv_transfer"} | BASE,
    "executor": {"parallel"} | BASE,  # the workers by name (EngineConfig.worker_cls)
    "worker": MODEL | {"spec_decode", "lora", "multimodal", "weight_sync", "kv_transfer"} | BASE,
    "spec_decode": {"model"} | BASE,
    "lora": {"model", "parallel"} | BASE,
    "multimodal": BASE,
    "weight_sync": {"model", "parallel", "multimodal"} | BASE,  # weight updates and sleep: plugs into core and worker
    "kv_transfer": BASE,  # the KV connector: plugs into the KV cache manager, the scheduler and the worker
    "quantization": {"model", "cpu_kernels"},
    "parallel": {"model"},
    "attention": {"kernels", "cpu_kernels"},
    "model": set(), "kernels": set(), "cpu_kernels": set(),
    "config": {"attention", "parallel", "quantization", "arg_types"},
    "outputs": set(),
    "errors": set(), "processes": set(), "arg_types": set(),
}


def stage5_room_graph(root: Path = ROOT, top: str = "stage5_server") -> dict[str, dict[str, list[str]]]:
    """Every room's imports, those for type hints alone included."""
    return layering_report.room_graph(layering_report.ModuleIndex(root), top, type_checking=None)


def two_way_pairs(graph: dict[str, dict[str, list[str]]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, {}))


def test_every_room_imports_only_the_rooms_its_layer_may_type_hints_included():
    graph = stage5_room_graph()
    assert set(graph) == set(ROOM_IMPORTS), "a room was added or removed: place it in ROOM_IMPORTS"
    unexpected = {room: {target: where[:2] for target, where in targets.items() if target not in ROOM_IMPORTS[room]}
                  for room, targets in graph.items()}
    assert {room: found for room, found in unexpected.items() if found} == {}


def test_no_two_rooms_import_each_other_type_hints_included():
    graph = stage5_room_graph()
    assert two_way_pairs(graph) == []
    assert layering_report.simple_cycles(graph) == []  # nor through others


def test_an_import_for_type_hints_alone_still_makes_a_two_way_pair(tmp_path):
    package = tmp_path / "stage9_rooms"
    for room in ("core", "executor"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "core" / "engine.py").write_text("from stage9_rooms.executor.run import Executor\n")
    (package / "executor" / "run.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                                 "    from stage9_rooms.core.engine import Output\n")
    assert two_way_pairs(stage5_room_graph(tmp_path, "stage9_rooms")) == [("core", "executor")]
