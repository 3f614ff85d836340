// AVX2 + FMA + F16C kernels (kernels_simd.inc) over SLEEF's vector
// functions. Compiled for those extensions by the target pragma (not by -m
// flags), so that nothing else in the worker assumes them; called only after
// cpuid reported them.
#include "kernels.h"

#if defined(__x86_64__)
#include <stdint.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

// From sleef.h, which declares these only when the compiler targets AVX.
extern "C" {
__m256 Sleef_expf8_u10avx2(__m256);
__m256 Sleef_expm1f8_u10avx2(__m256);
__m256 Sleef_logf8_u10avx2(__m256);
__m256 Sleef_log1pf8_u10avx2(__m256);
__m256 Sleef_erfcf8_u15avx2(__m256);
__m256 Sleef_sinf8_u10avx2(__m256);
__m256 Sleef_cosf8_u10avx2(__m256);
__m256 Sleef_powf8_u10avx2(__m256, __m256);
}

namespace moat::kernels {
namespace {

using V = __m256;
using M = __m256;
constexpr size_t W = 8;

V splat(float x) { return _mm256_set1_ps(x); }
V add(V a, V b) { return _mm256_add_ps(a, b); }
V sub(V a, V b) { return _mm256_sub_ps(a, b); }
V mul(V a, V b) { return _mm256_mul_ps(a, b); }
V div(V a, V b) { return _mm256_div_ps(a, b); }
V sqrt_(V a) { return _mm256_sqrt_ps(a); }
V min_(V a, V b) { return _mm256_min_ps(a, b); }
V max_(V a, V b) { return _mm256_max_ps(a, b); }
V fma_(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
V fms(V a, V b, V c) { return _mm256_fmsub_ps(a, b, c); }
V abs_(V a) { return _mm256_andnot_ps(splat(-0.0f), a); }
V sign_of(V a) { return _mm256_and_ps(splat(-0.0f), a); }
V or_(V a, V b) { return _mm256_or_ps(a, b); }
M gt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
V select(M m, V a, V b) { return _mm256_blendv_ps(b, a, m); }
M negative(V a) { return a; }  // blendv reads the sign bits
bool any_(M m) { return _mm256_movemask_ps(m) != 0; }
bool all_(M m) { return _mm256_movemask_ps(m) == 0xFF; }
// rcpps's 12 bits are too few for tanh's correction: both divide.
V recip_rough(V d) { return div(splat(1.0f), d); }
V recip(V d) { return div(splat(1.0f), d); }

V exp_(V x) { return Sleef_expf8_u10avx2(x); }
V exp_rough(V x) { return exp_(x); }
V expm1_(V x) { return Sleef_expm1f8_u10avx2(x); }
V log_(V x) { return Sleef_logf8_u10avx2(x); }
V log1p_(V x) { return Sleef_log1pf8_u10avx2(x); }
V erfc_(V x) { return Sleef_erfcf8_u15avx2(x); }
V sin_(V x) { return Sleef_sinf8_u10avx2(x); }
V cos_(V x) { return Sleef_cosf8_u10avx2(x); }
V pow_(V x, V y) { return Sleef_powf8_u10avx2(x, y); }

using D = __m256d;
D dsplat(double x) { return _mm256_set1_pd(x); }
D dmul(D a, D b) { return _mm256_mul_pd(a, b); }
D ddiv(D a, D b) { return _mm256_div_pd(a, b); }
void widen(V v, D& lo, D& hi) {
  lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
}
V narrow(D lo, D hi) { return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo)); }

const __m128i* in16(const void* p, size_t i) {
  return reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i);
}

__m128i* out16(void* p, size_t i) { return reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i); }

V load(Storage st, const void* p, size_t i) {
  switch (st) {
    case F32: return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    case F16: return _mm256_cvtph_ps(_mm_loadu_si128(in16(p, i)));
    case BF16: return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(in16(p, i))), 16));
  }
  return splat(0.0f);
}

// bf16 rounding as MLX's bfloat16_t does it: to nearest even, NaN to 0x7FC0.
__m128i to_bf16(V v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Pack the low halves of the 32-bit lanes (all < 0x10000) into 16-bit ones.
  __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

void store(Storage st, void* p, size_t i, V v) {
  switch (st) {
    case F32: _mm256_storeu_ps(static_cast<float*>(p) + i, v); return;
    case F16: _mm_storeu_si128(out16(p, i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); return;
    case BF16: _mm_storeu_si128(out16(p, i), to_bf16(v)); return;
  }
}

#include "kernels_simd.inc"

float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

float hmax(V v) {
  alignas(32) float t[W];
  _mm256_store_ps(t, v);
  float m = t[0];
  for (size_t i = 1; i < W; ++i) m = t[i] > m ? t[i] : m;
  return m;
}

#include "kernels_rows.inc"

}  // namespace

const Rows rows_avx2 = {rms_norm_row, attend_rows, dot_row, axpy_row};

void run_avx2(Op op, Storage st, const void* a, const void* b, void* out, size_t n) { run(op, st, a, b, out, n); }

}  // namespace moat::kernels

#pragma GCC pop_options
#endif
