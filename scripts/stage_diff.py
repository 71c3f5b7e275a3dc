"""What a stage changes, computed from the code: names it adds or replaces, methods it overrides, lines it adds.

    python scripts/stage_diff.py 3            # print stage 3's "What changed" section
    python scripts/stage_diff.py --write      # rewrite docs/snippets/what_changed_stageN.md for every stage

Because stage N imports stage N-1 and replaces only what it teaches, its change is exactly:

- the public names it exports that the stage before did not (new), and those it exports under
  the same name but from its own modules (replaced);
- for each class it defines, the base class it builds on and which methods it overrides or adds;
- the lines of code of its own modules (blank lines, comments and docstrings not counted).

``tests/test_docs.py`` checks that the pages' copies are current.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGES = {0: "shared", 1: "stage1_naive", 2: "stage2_paged", 3: "stage3_continuous", 4: "stage4_prefix_cache",
            5: "stage5_server"}


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text()
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)


def _owner(obj) -> str:
    return getattr(obj, "__module__", "") or ""


def _stage_of(module: str) -> str:
    return module.split(".")[0]


def _location(cls: type) -> str:
    return f"{_stage_of(cls.__module__)}.{cls.__qualname__}"


def defined_methods(cls: type) -> list[str]:
    """Methods written in the class body itself (not generated, e.g. a dataclass's __init__)."""
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            names = [item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
            return [n for n in names if not (n.startswith("__") and n.endswith("__")) or n == "__init__"]
    return []


def class_changes(cls: type, package: str) -> tuple[str | None, list[str], list[str]]:
    """(the base it builds on from an earlier stage or shared, methods overridden, methods added)."""
    bases = [b for b in cls.__mro__[1:] if _stage_of(b.__module__) in PACKAGES.values() and
             _stage_of(b.__module__) != package]
    base = bases[0] if bases else None
    own = defined_methods(cls)
    if base is None:
        return None, [], own
    overridden = [n for n in own if any(n in vars(b) for b in bases)]
    return _location(base), overridden, [n for n in own if n not in overridden]


def stage_change(stage: int) -> str:
    package = PACKAGES[stage]
    module = importlib.import_module(package)
    before = importlib.import_module(PACKAGES[stage - 1])
    names = [*module.__all__, "LLM"]  # every stage exports LLM, loaded on first use (in no __all__)
    earlier = {*getattr(before, "__all__", []), "LLM"} if stage > 1 else set()
    replaced = [n for n in names if n in earlier and getattr(module, n) is not getattr(before, n)]
    own = [n for n in names if n not in earlier and _stage_of(_owner(getattr(module, n))) == package]
    passed_on = [n for n in names if n not in earlier and n not in own]  # stage 1: shared's names
    kept = len([n for n in names if n in earlier and n not in replaced])
    lines = [f"<!-- Written by: python scripts/stage_diff.py --write (from the code of {package}/) -->", ""]
    if stage == 1:
        lines.append(f"`{package}` exports {len(names)} names: {len(own)} of its own, and {len(passed_on)} "
                     f"re-exported from `shared` ({', '.join(f'`{n}`' for n in sorted(passed_on))}).")
    else:
        lines.append(f"`{package}` exports {len(names)} names: {kept} re-exported unchanged from "
                     f"`{PACKAGES[stage - 1]}`, {len(replaced)} replaced, {len(own)} new.")
    lines += ["", "| name | module | what it is |", "|---|---|---|"]
    for name in sorted(set(own) | set(replaced), key=lambda n: (n not in replaced, n.lower())):
        obj = getattr(module, name)
        where = _owner(obj)
        if inspect.isclass(obj):
            base, overridden, added = class_changes(obj, package)
            if base:
                parts = [f"subclass of `{base}`"]
                if overridden:
                    parts.append("overrides " + ", ".join(f"`{m}`" for m in overridden))
                if added:
                    parts.append("adds " + ", ".join(f"`{m}`" for m in added))
                what = "; ".join(parts)
            else:
                what = "a new class" + (" of the same name (no common base)" if name in replaced else "")
        else:
            what = "a new function" if callable(obj) else "a new value"
        status = "replaced" if name in replaced else "new"
        lines.append(f"| `{name}` ({status}) | `{where}` | {what} |")
    folder = ROOT / package
    files = sorted(folder.rglob("*.py"))
    counted = [(f.relative_to(ROOT).as_posix(), code_lines(f)) for f in files]
    total = sum(n for _, n in counted)
    lines += ["", f"Lines of code added ({total} in {len(counted)} files; blank lines, comments and "
              "docstrings not counted):", ""]
    lines.append(", ".join(f"`{path}` {n}" for path, n in counted) + ".")
    return "\n".join(lines) + "\n"


def snippet_path(stage: int) -> Path:
    return ROOT / "docs" / "snippets" / f"what_changed_stage{stage}.md"


STAGES = [1, 2, 3, 4, 5]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stages", nargs="*", type=int, default=STAGES)
    parser.add_argument("--write", action="store_true", help="write docs/snippets/what_changed_stageN.md")
    args = parser.parse_args(argv)
    for stage in args.stages:
        text = stage_change(stage)
        if args.write:
            snippet_path(stage).write_text(text)
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
