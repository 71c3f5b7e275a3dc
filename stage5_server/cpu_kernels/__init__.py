"""stage5's C++ operators for CPUs, compiled on the machine that runs them.

Today one: decode attention that reads K/V in place through the block tables
(``paged_decode.py``, source in ``csrc/``), behind the ``cpu`` attention backend
(``attention/cpu_attn.py``). The GPU's kernels are Triton, in ``kernels/``.

vLLM: ``csrc/cpu/`` (its CPU operators) and ``cmake/cpu_extension.cmake`` (their build).
"""

from stage5_server.cpu_kernels.paged_decode import (
    build_report,
    cpu_decode_step_attention,
    cpu_paged_decode_attention,
    load_cpu_kernels,
)

__all__ = ["build_report", "cpu_decode_step_attention", "cpu_paged_decode_attention", "load_cpu_kernels"]
