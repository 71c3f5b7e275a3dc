// An int8 weight times activations quantized to int8 on the fly: a CPU's integer dot products.
//
// The weight is int8 with one scale per output row (w[n, k] ~ scale[n] * q[n, k]). Each input
// row's activations are quantized in groups of 64 along K, symmetrically (x ~ d[g] * c, c in
// -127..127), so the inner loop multiplies int8 by int8 and sums in int32: with AVX512-VNNI, one
// vpdpbusd does 64 of those products. That instruction takes one unsigned operand, so the codes go
// in shifted by 128 and 128 * sum(w) comes off again. Each group's int32 sums turn float once,
// times the group's d; the row's scale multiplies last. This is llama.cpp's way with a Q8_0 weight
// (activations as Q8 blocks, integer dot products), and it reads a quarter of float32's bytes.
// Without AVX512-VNNI the same arithmetic runs as plain loops (same results, slower).
//
// llama.cpp: ggml_vec_dot_q8_0_q8_0 in ggml/src/ggml-cpu/arch/x86/quants.c.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define STAGEDSERVE_VNNI 1
#endif

namespace {

constexpr int64_t kGroup = 64;  // activations per int8 scale
constexpr int64_t kRowsAtOnce = 4;  // input rows that share each loaded weight vector

// Row r's codes, shifted to 1..255, and one scale per group.
void quantize_activations(const float* x, int64_t rows, int64_t k, uint8_t* codes, float* scales) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = x + r * k + g * kGroup;
      float amax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f;
      const float inverse = d > 0.f ? 1.f / d : 0.f;
      scales[r * groups + g] = d;
      uint8_t* out = codes + r * k + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i)
        out[i] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(v[i] * inverse)) + 128);
    }
  }
}

// out[r, n] for r in [r0, r0 + rows) and n in [begin, end).
void dot_rows(const uint8_t* codes, const float* scales, const int8_t* weight, const float* row_scale, float* out,
              int64_t r0, int64_t rows, int64_t begin, int64_t end, int64_t k, int64_t n_total) {
  const int64_t groups = k / kGroup;
#ifdef STAGEDSERVE_VNNI
  const __m512i shift = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* w = weight + n * k;
    __m512 acc[kRowsAtOnce];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i wv = _mm512_loadu_si512(w + g * kGroup);
      const __m512i shifted = _mm512_dpbusd_epi32(_mm512_setzero_si512(), shift, wv);  // 128 * sum(w), by fours
      for (int64_t r = 0; r < rows; ++r) {
        const __m512i xv = _mm512_loadu_si512(codes + (r0 + r) * k + g * kGroup);
        const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, wv), shifted);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scales[(r0 + r) * groups + g]), acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) out[(r0 + r) * n_total + n] = _mm512_reduce_add_ps(acc[r]) * row_scale[n];
  }
#else
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* w = weight + n * k;
    for (int64_t r = 0; r < rows; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kGroup; ++i)
          dot += (static_cast<int32_t>(codes[(r0 + r) * k + g * kGroup + i]) - 128) * w[g * kGroup + i];
        total += static_cast<float>(dot) * scales[(r0 + r) * groups + g];
      }
      out[(r0 + r) * n_total + n] = total * row_scale[n];
    }
  }
#endif
}

// x [M, K] (any float dtype), weight int8 [N, K], scale float32 [N] -> [M, N] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && scale.dim() == 1, "int8_linear: x [M, K], weight [N, K], scale [N]");
  TORCH_CHECK(weight.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "int8_linear: weight must be int8 and scale float32");
  TORCH_CHECK(weight.is_contiguous() && scale.is_contiguous(), "int8_linear: weight and scale must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && scale.size(0) == n, "int8_linear: x ", x.sizes(), ", weight ", weight.sizes(),
              " and scale ", scale.sizes(), " do not fit");
  TORCH_CHECK(k % kGroup == 0, "int8_linear: the input size ", k, " is not a multiple of ", kGroup);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<uint8_t> codes(m * k);
  std::vector<float> scales(m * (k / kGroup));
  quantize_activations(xf.data_ptr<float>(), m, k, codes.data(), scales.data());
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* row_scale = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowsAtOnce)
      dot_rows(codes.data(), scales.data(), w, row_scale, o, r0, std::min(kRowsAtOnce, m - r0), begin, end, k, n);
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagedserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagedserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
