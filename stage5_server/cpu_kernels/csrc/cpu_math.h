// Float math the compiler turns into vector instructions, shared by the operators in this folder.
//
// VecF is 16 floats (GCC's vector extension: one AVX-512 register, two AVX2 ones, four NEON ones;
// the compiler picks what -march=native has). A cache row of bfloat16, float16 or float32 loads
// into it as float32 (float64, which the tests use, too).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace stagedserve_cpu {

// e^x as plain float arithmetic the compiler vectorizes (std::exp is a library call per element):
// x = n ln2 + r, 2^n from the exponent bits, e^r by its series to r^8 (relative error about 1e-7,
// a few of float32's ulps).
inline float exp_series(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.44269504089f;
  const float n = std::floor(t);
  const float r = (t - n) * 0.69314718056f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 +
                  r * (1.f / 5040 + r * (1.f / 40320))))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr int64_t kVecWidth = 16;
typedef float VecF __attribute__((vector_size(kVecWidth * sizeof(float))));

inline VecF load_vec(const float* src) {
  VecF v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

inline VecF load_vec(const c10::BFloat16* src) {  // bfloat16 is float32's upper half
  typedef uint16_t U16 __attribute__((vector_size(kVecWidth * sizeof(uint16_t))));
  typedef uint32_t U32 __attribute__((vector_size(kVecWidth * sizeof(uint32_t))));
  U16 half;
  std::memcpy(&half, src, sizeof(half));
  const U32 word = __builtin_convertvector(half, U32) << 16;
  VecF v;
  std::memcpy(&v, &word, sizeof(v));
  return v;
}

template <typename scalar_t>  // float16 and float64, element by element
inline VecF load_vec(const scalar_t* src) {
  float f[kVecWidth];
  for (int64_t i = 0; i < kVecWidth; ++i) f[i] = static_cast<float>(src[i]);
  return load_vec(f);
}

inline void store_vec(float* dst, VecF v) { std::memcpy(dst, &v, sizeof(v)); }

// The 16 lanes' sum by halving (four shuffles and adds, not sixteen lane extractions).
inline float sum_vec(VecF v) {
  typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float Vec4 __attribute__((vector_size(4 * sizeof(float))));
  const Vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

}  // namespace stagedserve_cpu
