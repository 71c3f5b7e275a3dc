"""Decode attention on a CPU that reads K/V in place: a small C++ operator, built on this machine.

``csrc/paged_decode.cpp`` registers ``torch.ops.stagedserve_cpu.paged_decode_attention``: for
each decoding sequence it walks the sequence's blocks through its block table, with no gather, no
padding to the batch's longest sequence and no mask. ``load_cpu_kernels`` compiles it once per
machine (``torch.utils.cpp_extension``, gcc, ``FLAGS``; ``-march=native`` ties a build to the CPU it
was made on, so the CPU's flags are part of its name; ``-ffast-math`` is for compiling only, never
linking, so loading it leaves the process's floating-point mode alone) into the stagedserve cache,
and loads that build afterwards without a compiler; it says why not where it cannot (no compiler,
no ninja): the ``cpu`` backend then keeps its SDPA path. ``make demo`` and ``make test`` build it
in their set-up, the CPU image while it is built.

vLLM: ``csrc/cpu/attention.cpp`` (``paged_attention_v1``) and its build in ``cmake/cpu_extension.cmake``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

from shared.tiny_model import cache_dir

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
logger = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def extension_name() -> str:
    """Source, flags, torch version and CPU in one name: a change to any of them builds afresh."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()
                            + _cpu_flags().encode())
    return f"stagedserve_cpu_{digest.hexdigest()[:12]}"


@functools.cache
def load_cpu_kernels() -> str | None:
    """Build (the first time on this machine) and load the operator; None if it runs, else why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return f"the C++ decode kernel is built for Linux on x86_64 or aarch64, not {platform.system()} " \
               f"on {platform.machine()}"
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        build = cache_dir() / "torch_extensions" / name
        library = build / f"{name}.so"
        if library.is_file():  # built before for this source, torch and CPU: no compiler needed
            torch.ops.load_library(str(library))
        else:
            build.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                               build_directory=str(build), is_python_module=False, verbose=False)
        torch.library.register_fake("stagedserve_cpu::decode_step_attention", _decode_step_attention_shape)
    except Exception as exc:  # no compiler, no ninja, a failed build: the SDPA path stays
        last_lines = [line.strip() for line in str(exc).splitlines() if line.strip()][-2:]
        why = f"the C++ decode kernel did not build ({type(exc).__name__}: {' / '.join(last_lines)[-300:]})"
        logger.warning("%s; decodes run SDPA over gathered blocks", why)
        return why
    return None


def cpu_paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               seq_index: torch.Tensor, query_rows: torch.Tensor, scale: float) -> None:
    """Write ``out[query_rows[i]]``, the attention of query row ``query_rows[i]`` over the first
    ``seq_lens[seq_index[i]]`` tokens of the blocks ``block_tables[seq_index[i]]`` lists.
    ``query``/``out`` ``[T, H, D]``; caches ``[num_blocks, block_size, Hkv, D]``."""
    torch.ops.stagedserve_cpu.paged_decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                     seq_index, query_rows, scale)


def cpu_decode_step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode-only step's attention for one layer, in one operator (what a compiled step holds):
    write row ``i``'s ``key``/``value`` ``[T, Hkv, D]`` to cache slot ``slot_mapping[i]`` (a negative
    slot is padding, not written), then attend query row ``i`` over sequence ``i``: the first
    ``seq_lens[i]`` tokens of the blocks ``block_tables[i]`` lists. Returns ``[T, H, D]``."""
    return torch.ops.stagedserve_cpu.decode_step_attention(query, key, value, key_cache, value_cache, slot_mapping,
                                                           block_tables, seq_lens, scale)


def _decode_step_attention_shape(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
                                 scale):
    """The operator's output for a graph being traced: shapes only (torch.library's fake kernel)."""
    return query.new_empty(query.shape)


def build_report() -> str:
    """Build now (``make``'s set-up, so that the first engine does not wait) and say what happened."""
    problem = load_cpu_kernels()
    return problem or f"C++ decode-attention operator: {extension_name()} built for this CPU"
