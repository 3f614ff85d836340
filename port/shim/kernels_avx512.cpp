// AVX-512F kernels (kernels_simd.inc) over SLEEF's vector functions; as
// kernels_avx2.cpp, compiled by target pragma and called only after cpuid
// reported AVX-512F.
#include "kernels.h"

#if defined(__x86_64__)
#include <stdint.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12's AVX-512 intrinsics start some results from deliberately
// undefined vectors, which -Wmaybe-uninitialized reports.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

// From sleef.h, which declares these only when the compiler targets AVX-512.
extern "C" {
__m512 Sleef_expm1f16_u10avx512f(__m512);
__m512 Sleef_log1pf16_u10avx512f(__m512);
__m512 Sleef_erfcf16_u15avx512f(__m512);
__m512 Sleef_sinf16_u10avx512f(__m512);
__m512 Sleef_cosf16_u10avx512f(__m512);
__m512 Sleef_powf16_u10avx512f(__m512, __m512);
}

namespace moat::kernels {
namespace {

using V = __m512;
using M = __mmask16;
constexpr size_t W = 16;

V splat(float x) { return _mm512_set1_ps(x); }
V add(V a, V b) { return _mm512_add_ps(a, b); }
V sub(V a, V b) { return _mm512_sub_ps(a, b); }
V mul(V a, V b) { return _mm512_mul_ps(a, b); }
V div(V a, V b) { return _mm512_div_ps(a, b); }
V sqrt_(V a) { return _mm512_sqrt_ps(a); }
V min_(V a, V b) { return _mm512_min_ps(a, b); }
V max_(V a, V b) { return _mm512_max_ps(a, b); }
V fma_(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
V fms(V a, V b, V c) { return _mm512_fmsub_ps(a, b, c); }
__m512i bits(V a) { return _mm512_castps_si512(a); }
V abs_(V a) { return _mm512_castsi512_ps(_mm512_and_epi32(bits(a), _mm512_set1_epi32(0x7FFFFFFF))); }
V sign_of(V a) { return _mm512_castsi512_ps(_mm512_and_epi32(bits(a), _mm512_set1_epi32(INT32_MIN))); }
V or_(V a, V b) { return _mm512_castsi512_ps(_mm512_or_epi32(bits(a), bits(b))); }
M gt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
V select(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }
M negative(V a) { return _mm512_cmplt_epi32_mask(bits(a), _mm512_setzero_si512()); }
bool any_(M m) { return m != 0; }
bool all_(M m) { return m == 0xFFFF; }
// rcp14 (within 2^-14) and a Newton step: within ~2^-23 (with rounding).
V recip_rough(V d) { return _mm512_rcp14_ps(d); }
V recip(V d) {
  V r = _mm512_rcp14_ps(d);
  return fma_(r, _mm512_fnmadd_ps(d, r, splat(1.0f)), r);
}

// e^x as 2^n e^r: n = round(x log2 e), r = x - n ln 2 (ln 2 split in two,
// so that r is exact to ~2^-32), e^r by Cephes' degree-6 polynomial on
// |r| <= ln 2 / 2, and 2^n put in by scalef, which rounds the denormal
// results once and overflows to infinity itself. Half SLEEF's instructions;
// max 0.79 ulp over every f32 (measured against f64). x is
// clamped to [-104, 89] first (min/max with x second keep NaN): e^x is 0
// below (after rounding) and infinite above.
// e^r 2^n for x = n ln 2 + r; `pair` carries 1 + r in two parts.
template <bool pair>
V exp_reduced(V x) {
  V n = _mm512_roundscale_ps(mul(x, splat(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm512_fnmadd_ps(n, splat(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, splat(-2.12194440e-4f), r);
  V p = splat(1.9875691500e-4f);
  p = fma_(p, r, splat(1.3981999507e-3f));
  p = fma_(p, r, splat(8.3334519073e-3f));
  p = fma_(p, r, splat(4.1665795894e-2f));
  p = fma_(p, r, splat(1.6666665459e-1f));
  p = fma_(p, r, splat(5.0000001201e-1f));
  V y;
  if (pair) {
    // 1 + r + r^2 p with 1 + r carried in two parts (1 >= |r|).
    V t = add(splat(1.0f), r);
    V c = add(sub(splat(1.0f), t), r);
    y = add(t, fma_(p, mul(r, r), c));
  } else {
    y = add(fma_(p, mul(r, r), r), splat(1.0f));
  }
  return _mm512_scalef_ps(y, n);
}

V exp_(V x) { return exp_reduced<true>(_mm512_max_ps(splat(-104.0f), _mm512_min_ps(splat(89.0f), x))); }

// For finite x of at most 88 in magnitude, within 1.01 ulp: where at most
// half of exp's error reaches the result (tanh_).
V exp_rough(V x) { return exp_reduced<false>(x); }

V expm1_(V x) { return Sleef_expm1f16_u10avx512f(x); }

// log x = e ln 2 + log(m) for x = m 2^e, m in [sqrt(1/2), sqrt(2)) (getmant
// and getexp, which take denormals as they are), log(m) = log1p(f) for
// f = m - 1 (exact) by Cephes' polynomial, f + f^2 Q(f); ln 2
// is added in two parts, the exact one last. fixupimm gives the special
// inputs their results: -inf for zeros, inf for inf, NaN for NaN, -inf and
// the negative values. Max 0.84 ulp over every f32 (measured).
V log_(V x) {
  V m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  V e = _mm512_getexp_ps(x);
  M up = _mm512_cmp_ps_mask(m, splat(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, up, m, splat(0.5f));
  e = _mm512_mask_add_ps(e, up, e, splat(1.0f));
  V f = sub(m, splat(1.0f));
  V z = mul(f, f);
  V p = splat(7.0376836292e-2f);
  p = fma_(p, f, splat(-1.1514610310e-1f));
  p = fma_(p, f, splat(1.1676998740e-1f));
  p = fma_(p, f, splat(-1.2420140846e-1f));
  p = fma_(p, f, splat(1.4249322787e-1f));
  p = fma_(p, f, splat(-1.6668057665e-1f));
  p = fma_(p, f, splat(2.0000714765e-1f));
  p = fma_(p, f, splat(-2.4999993993e-1f));
  p = fma_(p, f, splat(3.3333331174e-1f));
  p = fma_(p, f, splat(-0.5f));
  V y = fma_(p, z, mul(e, splat(-2.12194440e-4f)));
  V r = fma_(e, splat(0.693359375f), add(f, y));
  // Per class of x, low nibble first: QNaN, SNaN -> QNaN; zero -> -inf;
  // one -> r; -inf -> NaN; +inf -> +inf; negative -> NaN; positive -> r.
  return _mm512_fixupimm_ps(r, x, _mm512_set1_epi32(0x03530422), 0);
}

V log1p_(V x) { return Sleef_log1pf16_u10avx512f(x); }
V erfc_(V x) { return Sleef_erfcf16_u15avx512f(x); }
V sin_(V x) { return Sleef_sinf16_u10avx512f(x); }
V cos_(V x) { return Sleef_cosf16_u10avx512f(x); }
V pow_(V x, V y) { return Sleef_powf16_u10avx512f(x, y); }

using D = __m512d;
D dsplat(double x) { return _mm512_set1_pd(x); }
D dmul(D a, D b) { return _mm512_mul_pd(a, b); }
D ddiv(D a, D b) { return _mm512_div_pd(a, b); }
void widen(V v, D& lo, D& hi) {
  lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
V narrow(D lo, D hi) {
  __m512d low = _mm512_castpd256_pd512(_mm256_castps_pd(_mm512_cvtpd_ps(lo)));
  return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_castps_pd(_mm512_cvtpd_ps(hi)), 1));
}

const __m256i* in16(const void* p, size_t i) {
  return reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i);
}

__m256i* out16(void* p, size_t i) { return reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i); }

V load(Storage st, const void* p, size_t i) {
  switch (st) {
    case F32: return _mm512_loadu_ps(static_cast<const float*>(p) + i);
    case F16: return _mm512_cvtph_ps(_mm256_loadu_si256(in16(p, i)));
    case BF16: return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(in16(p, i))), 16));
  }
  return splat(0.0f);
}

// As kernels_avx2.cpp's to_bf16.
__m256i to_bf16(V v) {
  __m512i u = bits(v);
  __m512i lsb = _mm512_and_epi32(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

void store(Storage st, void* p, size_t i, V v) {
  switch (st) {
    case F32: _mm512_storeu_ps(static_cast<float*>(p) + i, v); return;
    case F16: _mm256_storeu_si256(out16(p, i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); return;
    case BF16: _mm256_storeu_si256(out16(p, i), to_bf16(v)); return;
  }
}

#include "kernels_simd.inc"

float hsum(V v) { return _mm512_reduce_add_ps(v); }

float hmax(V v) { return _mm512_reduce_max_ps(v); }

#include "kernels_rows.inc"

}  // namespace

const Rows rows_avx512 = {rms_norm_row, attend_rows, dot_row, axpy_row};

void run_avx512(Op op, Storage st, const void* a, const void* b, void* out, size_t n) { run(op, st, a, b, out, n); }

}  // namespace moat::kernels

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
