"""Faster linear layers on a CPU, each a ``LinearMethod`` behind stage 5's one linear seam
(``model/linear.py``): weights packed once for oneDNN (``packed.py``), weight-only int8 and int4
(``weight_only.py``), a GGUF file's own 4-bit blocks (``gguf.py``), and the engine arguments that
choose among them (``config.py``).

vLLM: ``vllm/model_executor/layers/quantization/`` (one ``QuantizationConfig`` and linear method per
format) and ``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``.
"""

from stage5_server.quantization.config import (
    QUANTIZATION_METHODS,
    LinearConfig,
    install_linear_methods,
    resolve_linear_config,
    source_gguf_file,
)
from stage5_server.quantization.gguf import gguf_linear_methods
from stage5_server.quantization.packed import PackedLinearMethod, pack_weight, packing_available
from stage5_server.quantization.weight_only import Int4Groups, Int4LinearMethod, Int8LinearMethod, kernel_available

__all__ = ["QUANTIZATION_METHODS", "Int4Groups", "Int4LinearMethod", "Int8LinearMethod", "LinearConfig",
           "PackedLinearMethod", "gguf_linear_methods", "install_linear_methods", "kernel_available",
           "pack_weight", "packing_available", "resolve_linear_config", "source_gguf_file"]
