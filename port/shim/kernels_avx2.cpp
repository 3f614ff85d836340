// AVX2 + FMA + F16C kernels over SLEEF's vector functions. Compiled for
// those extensions by the target pragma (not by -m flags), so that nothing
// else in the worker assumes them; called only after cpuid reported them.
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
__m256 Sleef_tanhf8_u10avx2(__m256);
__m256 Sleef_erfcf8_u15avx2(__m256);
__m256 Sleef_sinf8_u10avx2(__m256);
__m256 Sleef_cosf8_u10avx2(__m256);
__m256 Sleef_powf8_u10avx2(__m256, __m256);
}

namespace moat::kernels {
namespace {

__m256 load8(Storage st, const void* p, size_t i) {
  switch (st) {
    case F32:
      return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    case F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    case BF16: {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  return _mm256_setzero_ps();
}

// bf16 rounding as MLX's bfloat16_t does it: to nearest even, NaN to 0x7FC0.
__m128i to_bf16(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Pack the low halves of the 32-bit lanes (all < 0x10000) into 16-bit ones.
  __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

void store8(Storage st, void* p, size_t i, __m256 v) {
  switch (st) {
    case F32:
      _mm256_storeu_ps(static_cast<float*>(p) + i, v);
      return;
    case F16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i),
                       _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    case BF16:
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), to_bf16(v));
      return;
  }
}

size_t elem_size(Storage st) { return st == F32 ? 4 : 2; }

// sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below, so that
// neither overflows and the small results (down to the denormals) keep
// their precision.
__m256 sigmoid8(__m256 x) {
  __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), ax));
  __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_blendv_ps(r, _mm256_mul_ps(e, r), x);
}

// erf after Norbert Juffa's erff (max error 0.99 ulp, measured): x * P(x^2)
// for |x| <= 0.9277, else 1 - exp(Q(|x|)) with |x| clamped to 4, where erf
// is 1 in f32. Four times faster than SLEEF's erff here.
__m256 fma(__m256 x, __m256 y, float z) { return _mm256_fmadd_ps(x, y, _mm256_set1_ps(z)); }

__m256 erf8(__m256 a) {
  __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 t = _mm256_andnot_ps(sign, a);
  __m256 s = _mm256_mul_ps(a, a);
  __m256 tc = _mm256_min_ps(t, _mm256_set1_ps(4.0f));
  __m256 sc = _mm256_mul_ps(tc, tc);
  __m256 r = fma(_mm256_set1_ps(-1.72853470e-5f), tc, 3.83197126e-4f);
  __m256 u = fma(_mm256_set1_ps(-3.88396438e-3f), tc, 2.42546219e-2f);
  r = _mm256_fmadd_ps(r, sc, u);
  r = fma(r, tc, -1.06777877e-1f);
  r = fma(r, tc, -6.34846687e-1f);
  r = fma(r, tc, -1.28717512e-1f);
  r = _mm256_fmsub_ps(r, tc, tc);
  __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f), Sleef_expf8_u10avx2(r));
  big = _mm256_or_ps(big, _mm256_and_ps(sign, a));
  __m256 p = _mm256_set1_ps(-5.96761703e-4f);
  p = fma(p, s, 4.99119423e-3f);
  p = fma(p, s, -2.67681349e-2f);
  p = fma(p, s, 1.12819925e-1f);
  p = fma(p, s, -3.76125336e-1f);
  p = fma(p, s, 1.28379166e-1f);
  __m256 small = _mm256_fmadd_ps(p, a, a);
  return _mm256_blendv_ps(small, big, _mm256_cmp_ps(t, _mm256_set1_ps(0.927734375f), _CMP_GT_OQ));
}

// SLEEF 3.5's log1pf overflows above ~1e38, where log1p(x) rounds to log(x).
__m256 log1p8(__m256 x) {
  __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(1e38f), _CMP_GT_OQ);
  return _mm256_blendv_ps(Sleef_log1pf8_u10avx2(x), Sleef_logf8_u10avx2(x), big);
}

__m256 rsqrt8(__m256 x) { return _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(x)); }

__m256 apply(Op op, __m256 x, __m256 y) {
  switch (op) {
    case EXP: return Sleef_expf8_u10avx2(x);
    case EXPM1: return Sleef_expm1f8_u10avx2(x);
    case LOG: return Sleef_logf8_u10avx2(x);
    case LOG1P: return log1p8(x);
    case TANH: return Sleef_tanhf8_u10avx2(x);
    case SIGMOID: return sigmoid8(x);
    case ERF: return erf8(x);
    case ERFC: return Sleef_erfcf8_u15avx2(x);
    case SIN: return Sleef_sinf8_u10avx2(x);
    case COS: return Sleef_cosf8_u10avx2(x);
    case RSQRT: return rsqrt8(x);
    case POW: return Sleef_powf8_u10avx2(x, y);
    case OP_COUNT: break;
  }
  return x;
}

// One loop per op, so that the switch in apply() folds away.
template <Op op>
void loop(Storage st, const void* a, const void* b, void* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 y = op == POW ? load8(st, b, i) : _mm256_setzero_ps();
    store8(st, out, i, apply(op, load8(st, a, i), y));
  }
  if (i == n) return;
  // The tail, through a zero-padded block of eight.
  alignas(32) unsigned char ta[32] = {}, tb[32] = {}, to[32];
  size_t bytes = (n - i) * elem_size(st);
  __builtin_memcpy(ta, static_cast<const unsigned char*>(a) + i * elem_size(st), bytes);
  if (op == POW) __builtin_memcpy(tb, static_cast<const unsigned char*>(b) + i * elem_size(st), bytes);
  store8(st, to, 0, apply(op, load8(st, ta, 0), load8(st, tb, 0)));
  __builtin_memcpy(static_cast<unsigned char*>(out) + i * elem_size(st), to, bytes);
}

}  // namespace

void run_avx2(Op op, Storage st, const void* a, const void* b, void* out, size_t n) {
  switch (op) {
    case EXP: return loop<EXP>(st, a, b, out, n);
    case EXPM1: return loop<EXPM1>(st, a, b, out, n);
    case LOG: return loop<LOG>(st, a, b, out, n);
    case LOG1P: return loop<LOG1P>(st, a, b, out, n);
    case TANH: return loop<TANH>(st, a, b, out, n);
    case SIGMOID: return loop<SIGMOID>(st, a, b, out, n);
    case ERF: return loop<ERF>(st, a, b, out, n);
    case ERFC: return loop<ERFC>(st, a, b, out, n);
    case SIN: return loop<SIN>(st, a, b, out, n);
    case COS: return loop<COS>(st, a, b, out, n);
    case RSQRT: return loop<RSQRT>(st, a, b, out, n);
    case POW: return loop<POW>(st, a, b, out, n);
    case OP_COUNT: return;
  }
}

}  // namespace moat::kernels

#pragma GCC pop_options
#endif
