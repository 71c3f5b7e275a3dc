"""What every benchmark shares: the run's provenance, where its results go, and a best-of timer."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name and the matrix extensions it has (what decides a CPU run's speed)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    extensions = [label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"),
                                            ("avx512f", "AVX-512")) if flag in flags]
    return f"{name} with {extensions[0]}" if extensions else name


def bf16_checkpoint(model_dir: str | Path) -> str:
    """``model_dir`` (a Hugging Face directory) saved in bfloat16 beside it in the stagedserve cache, once:
    the checkpoint a user downloads, for the engines that compare on the same weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from shared.cache import cache_dir

    source = Path(model_dir)
    target = cache_dir() / f"{source.name}-bf16"
    if (target / "model.safetensors").is_file():
        return str(target)
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix == ".safetensors" or path.name in ("config.json", "model.safetensors.index.json"):
            continue  # the weights, one file
        (partial / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(path))
    save_file({name: t.to(torch.bfloat16).contiguous() if t.is_floating_point() else t
               for name, t in tensors.items()}, partial / "model.safetensors", metadata={"format": "pt"})
    partial.rename(target)
    return str(target)


def best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, after one call that warms it up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_info(module: str, argv: list[str] | None) -> dict:
    """Date, machine and the exact command line (no absolute paths)."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"system": platform.system(), "machine": platform.machine(),
                    "processor": cpu_model(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version()},
        "command": " ".join(["python", "-m", module, *(shlex.quote(without_machine_paths(a)) for a in args)]),
    }


def without_machine_paths(arg: str) -> str:
    """An absolute path as ``<dir>/last/two`` (this machine's layout stays out of the results)."""
    path = Path(arg)
    if not path.is_absolute() or len(path.parts) < 4:
        return arg
    return f"<{path.parts[-3]}>/{path.parts[-2]}/{path.parts[-1]}"


def provenance(result: dict, details: str = "") -> str:
    """``Produced by `COMMAND` on DATE (PROCESSOR, N CPUs, DETAILS)``: the first line of every report."""
    machine = result["machine"]
    extra = f", {details}" if details else ""
    return (f"Produced by `{result['command']}` on {result['date']} ({machine['processor']}, "
            f"{machine['cpu_count']} CPUs{extra})")


def benchmark_parser(doc: str, name: str, plot: bool = False) -> argparse.ArgumentParser:
    """The arguments every benchmark takes, with its report's default places: ``--out-dir`` for the
    JSON, ``--markdown`` for the table the docs include, and ``--plot`` where it draws a figure."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--markdown", default=f"docs/results/{name}.md")
    if plot:
        parser.add_argument("--plot", default=f"docs/assets/{name}.png")
    return parser


def write_results(name: str, result: dict, markdown_text: str, out_dir: str | Path, markdown_path: str | Path) -> None:
    """``<out_dir>/<name>.json`` for the numbers, the markdown table for the docs; echo the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
    Path(markdown_path).write_text(markdown_text)
    print(markdown_text)


def save_figure(fig, path: str | Path) -> None:
    """Lay out, write and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
