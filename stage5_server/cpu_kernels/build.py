"""Build and load stage5's C++ CPU operators, once per machine.

``load_cpu_kernels`` compiles every source in ``csrc/`` into one library (``torch.utils.cpp_extension``,
gcc, ``FLAGS``; ``-march=native`` ties a build to the CPU it was made on, so the CPU's flags are part
of its name; ``-ffast-math`` is for compiling only, never linking, so loading it leaves the process's
floating-point mode alone) in the stagedserve cache, and loads that build afterwards without a
compiler. Where it cannot (no compiler, no ninja) it says why, and the callers keep their torch paths.
``make demo`` and ``make test`` build it in their set-up, the CPU image while it is built. Each
operator a compiled graph holds gets a fake kernel here (``torch.library.register_fake``): the shape
of its output, all that tracing needs.

vLLM: ``cmake/cpu_extension.cmake``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

from shared.cache import cache_dir

SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))
HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
logger = logging.getLogger(__name__)


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), or what ``platform`` says of it elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def extension_name() -> str:
    """Sources and headers, flags, torch version and CPU in one name: a change to any of them builds afresh."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in [*SOURCES, *HEADERS]) + " ".join(FLAGS).encode()
                            + torch.__version__.encode() + cpu_flags().encode())
    return f"stagedserve_cpu_{digest.hexdigest()[:12]}"


@functools.cache
def load_cpu_kernels() -> str | None:
    """Build (the first time on this machine) and load the operators; None if they run, else why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"the C++ CPU operators are built for Linux on x86_64 or aarch64, not {platform.system()} " \
               f"on {platform.machine()}"
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        build = cache_dir() / "torch_extensions" / name
        library = build / f"{name}.so"
        if library.is_file():  # built before for these sources, torch and CPU: no compiler needed
            torch.ops.load_library(str(library))
        else:
            build.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name, [str(source) for source in SOURCES], extra_cflags=FLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                               verbose=False)
        # Shapes only, for a graph being traced (torch.library's fake kernels).
        torch.library.register_fake("stagedserve_cpu::decode_step_attention",
                                    lambda query, *args: query.new_empty(query.shape))
        torch.library.register_fake("stagedserve_cpu::int8_linear",
                                    lambda x, weight, scale: x.new_empty((x.shape[0], weight.shape[0])))
        torch.library.register_fake("stagedserve_cpu::packed_linear",
                                    lambda x, weight, bias, out_features: x.new_empty((*x.shape[:-1], out_features)))
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths stay
        last_lines = [line.strip() for line in str(exc).splitlines() if line.strip()][-2:]
        why = f"the C++ CPU operators did not build ({type(exc).__name__}: {' / '.join(last_lines)[-300:]})"
        logger.warning("%s; the torch paths stay (decodes: SDPA over gathered blocks)", why)
        return why
    return None


def build_report() -> str:
    """Build now (``make``'s set-up, so that the first engine does not wait) and say what happened."""
    problem = load_cpu_kernels()
    built = f"{extension_name()} built for this CPU"
    return problem or f"C++ CPU operators (decode attention, int8 and packed linear, elementwise): {built}"
