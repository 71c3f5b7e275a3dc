"""stage5's C++ operators for CPUs, compiled on the machine that runs them.

Four kinds, from the sources in ``csrc/``, built together (``build.py``): decode attention that
reads K/V in place through the block tables (``paged_decode.py``), behind the ``cpu`` attention
backend (``attention/cpu_attn.py``); an int8 weight times int8-quantized activations on
AVX512-VNNI (``int8_linear.py``), behind the int8 linear method (``quantization/weight_only.py``);
oneDNN's packed GEMM as an operator a compiled graph holds (``packed_linear.py``), behind the packed
linear method (``quantization/packed.py``); and a layer's elementwise parts in one pass each
(``elementwise.py``), behind the model's elementwise seam (``model/fused.py``). The GPU's kernels
are Triton, in ``kernels/``.

vLLM: ``csrc/cpu/`` (its CPU operators) and ``cmake/cpu_extension.cmake`` (their build).
"""

from stage5_server.cpu_kernels.build import build_report, load_cpu_kernels
from stage5_server.cpu_kernels.elementwise import CPUElementwiseKernels, cpu_elementwise_kernels
from stage5_server.cpu_kernels.int8_linear import cpu_int8_linear, int8_dot_problem
from stage5_server.cpu_kernels.packed_linear import cpu_packed_linear
from stage5_server.cpu_kernels.paged_decode import cpu_decode_step_attention, cpu_paged_decode_attention

__all__ = ["CPUElementwiseKernels", "build_report", "cpu_decode_step_attention", "cpu_elementwise_kernels",
           "cpu_int8_linear", "cpu_packed_linear", "cpu_paged_decode_attention", "int8_dot_problem",
           "load_cpu_kernels"]
