"""The machine's own limits, measured, and the time a workload's products would take at them.

A library's speed at the model's shapes (``cpu_roofline.gemm_times``) is one roofline; the machine's is
another. This module measures the machine's:

- the vector units' peak: a hand-timed C loop of fused multiply-adds on 16-float vectors (twelve
  independent accumulators, so the units never wait on a result), built with ``gcc -O3
  -march=native`` and run as one process per core at once; float32, the units every dtype's
  arithmetic ends in on a CPU without matrix units;
- the peak of a large square GEMM in each dtype through torch (oneDNN or MKL): where the CPU has
  matrix units (AMX) or bfloat16 dot products, this is where a library reaches them;
- the read bandwidth: a sum over a buffer larger than any cache;

and, for a schedule of steps (``cpu_roofline.ideal_schedule``), the time each step's products take
at the larger of the two peaks or the time its weights take to read once at that bandwidth,
whichever is longer, summed: the products' floor for that workload on this machine.

    python -m benchmarks.machine_roofline
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from benchmarks.common import best_seconds
from shared import ModelConfig

FMA_LOOP = textwrap.dedent("""
    #include <stdio.h>
    #include <time.h>
    typedef float v16 __attribute__((vector_size(64)));
    int main(int argc, char** argv) {
      long iterations = 200000000 / 12;
      v16 acc[12], x, y;
      for (int i = 0; i < 16; ++i) { x[i] = 1.0f + i * 1e-7f; y[i] = 0.999999f; }
      for (int j = 0; j < 12; ++j) acc[j] = x * (float)(j + 1);
      struct timespec a, b;
      clock_gettime(CLOCK_MONOTONIC, &a);
      for (long i = 0; i < iterations; ++i) {
        for (int j = 0; j < 12; ++j) acc[j] = acc[j] * y + x;  /* one FMA each: no reordering without -ffast-math */
      }
      clock_gettime(CLOCK_MONOTONIC, &b);
      float sum = 0;
      for (int j = 0; j < 12; ++j) for (int i = 0; i < 16; ++i) sum += acc[j][i];
      double seconds = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
      printf("%f %f\\n", iterations * 12.0 * 16 * 2 / seconds / 1e9, sum);
      return 0;
    }
""")


def fma_peak_gflops(processes: int) -> float | None:
    """float32 GFLOP/s of the hand-timed FMA loop, one process per core at once; None without gcc."""
    if shutil.which("gcc") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "fma.c", Path(tmp) / "fma"
        source.write_text(FMA_LOOP)
        subprocess.run(["gcc", "-O3", "-march=native", str(source), "-o", str(binary)], check=True)
        runs = [subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        return sum(float(run.communicate()[0].split()[0]) for run in runs)


def gemm_peak_gflops(dtype: torch.dtype, size: int = 4096, repeats: int = 3) -> float:
    """GFLOP/s of the best of ``repeats`` square ``size`` GEMMs in ``dtype`` on torch's threads."""
    a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
    return 2 * size**3 / best_seconds(lambda: a @ b, repeats) / 1e9


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a sum over a float32 buffer of ``nbytes`` (larger than any cache)."""
    buffer = torch.ones(nbytes // 4)
    buffer.sum()
    start = time.perf_counter()
    for _ in range(3):
        buffer.sum()
    return 3 * nbytes / (time.perf_counter() - start)


def model_products(cfg: ModelConfig) -> tuple[int, int]:
    """(weights of the layers' products, weights of the LM head): each weight is one multiply-add a row."""
    hd = cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    per_layer = cfg.hidden_size * qkv + cfg.num_attention_heads * hd * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    return per_layer * cfg.num_hidden_layers, cfg.vocab_size * cfg.hidden_size


def products_floor_seconds(cfg: ModelConfig, steps: list[tuple[int, int]], peak_gflops: float,
                           bandwidth: float, bytes_per_weight: int) -> float:
    """Each step (tokens, sampled rows): its products' FLOPs at the peak, or its weights read once at the
    bandwidth, whichever is longer; summed over the steps."""
    layers, head = model_products(cfg)
    total = 0.0
    for tokens, sampled in steps:
        flops = 2 * (tokens * layers + sampled * head)
        weight_bytes = (layers + (head if sampled else 0)) * bytes_per_weight
        total += max(flops / (peak_gflops * 1e9), weight_bytes / bandwidth)
    return total


def measure(threads: int, gemm_size: int = 4096) -> dict:
    """The machine's peaks, each measured once."""
    return {"fma_float32_gflops": fma_peak_gflops(threads),
            "gemm_gflops": {name: gemm_peak_gflops(dtype, gemm_size) for name, dtype in
                            (("float32", torch.float32), ("bfloat16", torch.bfloat16))},
            "read_gb_s": read_bandwidth() / 1e9}


def describe(machine: dict) -> str:
    fma = machine["fma_float32_gflops"]
    gemm = machine["gemm_gflops"]
    return (f"vector FMA loop {fma:.0f} GFLOP/s in float32; " if fma else "no gcc for the FMA loop; ") + \
        f"4096^3 GEMM {gemm['float32']:.0f} GFLOP/s in float32 and {gemm['bfloat16']:.0f} in bfloat16; " \
        f"read bandwidth {machine['read_gb_s']:.1f} GB/s"


def main() -> None:
    threads = torch.get_num_threads()
    print(f"{threads} threads ({os.cpu_count()} CPUs): {describe(measure(threads))}")


if __name__ == "__main__":
    main()
