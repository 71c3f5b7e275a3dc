"""Make a learner's copy of the repository with a stage's key functions blanked out.

    python scripts/make_exercises.py --stage 3 --out build/exercises
    cd build/exercises/stage3 && make test STAGE=3

Each listed function keeps its signature and docstring; its body becomes
``raise NotImplementedError``. The stage's own tests and the invariant suite then check
the learner's version. The reference solution in the repository is never modified.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# stage -> {file: [qualified function names]}; the ideas each stage teaches.
EXERCISES: dict[int, dict[str, list[str]]] = {
    1: {"stage1_naive/kv_cache.py": ["ContiguousKVCache.reserve", "ContiguousKVCache.release",
                                     "ContiguousKVCache.external_fragmentation"]},
    2: {"stage2_paged/block_table.py": ["BlockTable.blocks_needed", "slot_mapping"],
        "stage2_paged/attention.py": ["gather_kv"]},
    3: {"stage3_continuous/scheduler.py": ["Scheduler.schedule", "Scheduler.update_from_output",
                                           "Scheduler._preempt"]},
    4: {"stage4_prefix_cache/kv_cache_manager.py": ["KVCacheManager.get_computed_blocks"],
        "stage4_prefix_cache/block_pool.py": ["BlockPool.free_blocks", "BlockPool.touch"],
        "stage4_prefix_cache/kv_cache_utils.py": ["hash_block_tokens"]},
    5: {"stage5_server/attention/__init__.py": ["resolve_attention_backend"]},
}


def _functions(tree: ast.Module):
    """Yield (qualified name, node) for top-level functions and methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def blank_functions(source: str, names: list[str]) -> str:
    """Replace the bodies of ``names`` (keeping docstrings) with ``raise NotImplementedError``."""
    tree = ast.parse(source)
    found = {name: node for name, node in _functions(tree) if name in names}
    missing = sorted(set(names) - set(found))
    if missing:
        raise ValueError(f"exercise functions not found: {missing}")
    lines = source.splitlines(keepends=True)
    # Work bottom-up so earlier line numbers stay valid.
    for name, node in sorted(found.items(), key=lambda item: -item[1].lineno):
        body = node.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str)
        first = body[1] if has_doc and len(body) > 1 else (None if has_doc else body[0])
        indent = " " * (body[-1].col_offset)
        stub = f'{indent}raise NotImplementedError("exercise: implement {name}")\n'
        start = (first.lineno if first is not None else body[0].end_lineno + 1) - 1
        lines[start:node.end_lineno] = [stub]
    return "".join(lines)


def make_copy(stage: int, out: Path) -> Path:
    if stage not in EXERCISES:
        raise ValueError(f"stage: choose one of {sorted(EXERCISES)}")
    target = out / f"stage{stage}"
    if target.exists():
        shutil.rmtree(target)
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, target / rel)
    for rel, names in EXERCISES[stage].items():
        path = target / rel
        path.write_text(blank_functions(path.read_text(), names))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "exercises")
    args = parser.parse_args(argv)
    target = make_copy(args.stage, args.out)
    print(f"learner copy for stage {args.stage}: {target}")
    for rel, names in EXERCISES[args.stage].items():
        print(f"  {rel}: {', '.join(names)}")
    print(f"then: cd {target} && make test STAGE={args.stage}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
