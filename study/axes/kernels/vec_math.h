// Vectorisable math shared by the kernels in this folder (study/axes/cpu_kernels.py folds this file's hash into each
// build's flags, so that editing it rebuilds them).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace study_kernels {

// exp(x) for x <= 0, written so that `omp simd` vectorises it: std::exp and std::floor do not vectorise without
// -ffast-math, which would also drop the infinities the kernels rely on. Cody-Waite reduction with ln 2 split in two
// (Cody & Waite 1980), a degree-6 Taylor polynomial on |r| <= ln2/2, 2^n by building the exponent: about 2 ulp.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38: below it a term is negligible against the max's 1
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: add 1.5 * 2^23
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  return p * __builtin_bit_cast(float, bits);
}

// float64 (gradcheck's dtype, not a hot path): the library's exp, so that a kernel's formula can be one template.
inline double exp_nonpositive(double x) { return std::exp(x); }

// sum_{j < n} term(j) in kSumLanes partial sums, added pairwise at the end: an order fixed here, so a row's sum is the
// same on every CPU and as accurate as 32 lanes make it. `omp simd reduction(+ : ...)` leaves the order to the
// compiler: GCC 12 with -mavx2 kept the serial one (a fold-left reduction), one float accumulator over a row of 8,000
// exps that lost 2e-5 of a log-sum-exp (torch's log_softmax: 3e-6), while AVX-512 builds summed in lanes.
constexpr int64_t kSumLanes = 32;

template <typename Term>
inline float lane_sum(int64_t n, Term term) {
  float part[kSumLanes] = {};
  int64_t j = 0;
  for (; j + kSumLanes <= n; j += kSumLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kSumLanes; ++l) part[l] += term(j + l);
  }
  for (int64_t l = 0; j < n; ++j, ++l) part[l] += term(j);
  for (int64_t width = kSumLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  }
  return part[0];
}

// Loads and stores by bit operations, so that `omp simd` vectorises the bf16 loops (c10::BFloat16's conversions do
// not vectorise: the SwiGLU kernel ran 2.4x slower than eager PyTorch with them). bf16 is float's upper half; a store
// rounds to nearest even, as c10 does, NaN kept NaN.
inline float load(const float* p, int64_t j) { return p[j]; }
inline double load(const double* p, int64_t j) { return p[j]; }
inline float load(const c10::Half* p, int64_t j) { return static_cast<float>(p[j]); }
inline float load(const c10::BFloat16* p, int64_t j) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16);
}
inline void store(float* p, int64_t j, float v) { p[j] = v; }
inline void store(double* p, int64_t j, double v) { p[j] = v; }
inline void store(c10::BFloat16* p, int64_t j, float v) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, v);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[j] = static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
}

}  // namespace study_kernels
