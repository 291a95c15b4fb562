// Vectorisable math shared by the kernels in this folder (study/axes/cpu_kernels.py folds this file's hash into each
// build's flags, so that editing it rebuilds them).
#pragma once

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

}  // namespace study_kernels
