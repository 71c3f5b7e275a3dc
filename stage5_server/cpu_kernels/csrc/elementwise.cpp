// The elementwise parts of a decoder layer, one pass each: RMSNorm, SiLU(gate) * up, and the
// rotate-half RoPE. In eager PyTorch each is four to six operator calls over the whole tensor (a
// cast to float, a square, a mean, a multiply...), each reading and writing memory again; here one
// loop over the rows does the float math in registers.
//
// Each keeps the reference's roundings (shared/model.py, stage5_server/model/fused.py): where the
// torch code rounds an intermediate to the model's dtype, so does this, so a bfloat16 result differs
// from eager only where a float sum's order does (closeness is checked in the tests).
//
// vLLM: csrc/cpu/layernorm.cpp (rms_norm), csrc/cpu/activation.cpp (silu_and_mul) and
// csrc/cpu/pos_encoding.cpp (rotary_embedding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace {

using stagedserve_cpu::exp_series;  // e^x for the SiLU, vectorized

constexpr int64_t kChunk = 256;

// The value as the model's dtype holds it: a round trip through scalar_t.
template <typename scalar_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t width,
                   int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = x + r * x_stride;
      float sum = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        float v = static_cast<float>(row[i]);
        sum += v * v;
      }
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      scalar_t* dst = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float normed = round_to<scalar_t>(static_cast<float>(row[i]) * scale);
        dst[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * normed);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "rms_norm: the last dimension must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [width] in x's dtype");
  const int64_t width = x.size(-1);
  at::Tensor rows = x.reshape({-1, width});  // a view where it can be
  TORCH_CHECK(rows.stride(1) == 1, "rms_norm: rows must be contiguous");
  at::Tensor out = at::empty(rows.sizes(), x.options());
  const at::Tensor w = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(rows.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            rows.size(0), width, rows.stride(0), static_cast<float>(eps));
  });
  return out.view(x.sizes());
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be [rows, 2 * width] with contiguous rows");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = src + r * stride;
        const scalar_t* up = gate + width;
        scalar_t* o = dst + r * width;
        for (int64_t start = 0; start < width; start += kChunk) {  // plain float loops: vectorized
          const int64_t n = std::min(kChunk, width - start);
          float g[kChunk], e[kChunk];
          for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(gate[start + i]);
          for (int64_t i = 0; i < n; ++i) e[i] = exp_series(-g[i]);
          for (int64_t i = 0; i < n; ++i) {
            const float activated = round_to<scalar_t>(g[i] / (1.f + e[i]));
            o[start + i] = static_cast<scalar_t>(activated * static_cast<float>(up[start + i]));
          }
        }
      }
    });
  });
  return out;
}

// x: [T, H, D] (rows of any stride, heads and dims contiguous); cos/sin: [T, 1, D] contiguous.
at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotate_half: x must be [tokens, heads, head_dim] with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "rotate_half: head_dim must be even");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.numel() == tokens * dim && s.numel() == tokens * dim && c.scalar_type() == x.scalar_type() &&
                  s.scalar_type() == x.scalar_type(),
              "rotate_half: cos and sin must be [tokens, 1, head_dim] in x's dtype");
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotate_half", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* cs = c.data_ptr<scalar_t>();
    const scalar_t* sn = s.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t row_stride = x.stride(0);
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* ct = cs + t * dim;
        const scalar_t* st = sn + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* v = src + t * row_stride + h * dim;
          scalar_t* o = dst + (t * heads + h) * dim;
          for (int64_t i = 0; i < dim; ++i) {
            // x * cos + cat(-x[half:], x[:half]) * sin, each product rounded as the torch code rounds it
            const float rotated = i < half ? -static_cast<float>(v[i + half]) : static_cast<float>(v[i - half]);
            const float a = round_to<scalar_t>(static_cast<float>(v[i]) * static_cast<float>(ct[i]));
            const float b = round_to<scalar_t>(rotated * static_cast<float>(st[i]));
            o[i] = static_cast<scalar_t>(a + b);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagedserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotate_half(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagedserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotate_half", &rotate_half);
}
