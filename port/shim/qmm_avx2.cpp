// The quantized product with AVX2 + FMA (+ F16C for f16 scales): eight
// values of a weight row at a time are unpacked with variable shifts,
// dequantized (scale * q + bias, as MLX's dequantize) and multiplied into
// up to four rows of x, for several weight rows at once so that the FMA
// chains overlap. Compiled for those extensions by the target pragma, as
// kernels_avx2.cpp; called only after cpuid reported them.
#include "qmm.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace moat::qmm {
namespace {

float scale_at(Scale st, const void* p, size_t i) {
  switch (st) {
    case F32: return static_cast<const float*>(p)[i];
    case F16: return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
    case BF16: {
      uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      __builtin_memcpy(&f, &u, 4);
      return f;
    }
  }
  return 0.0f;
}

// The eight values of `row` from value k on (k a multiple of 8), as int32
// lanes. Reads exactly the bytes that hold them.
template <int BITS>
__m256i unpack8(const uint8_t* row, int k) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
  } else if constexpr (BITS == 6) {
    uint64_t v = 0;
    __builtin_memcpy(&v, row + k / 8 * 6, 6);
    __m256i both = _mm256_set_m128i(_mm_set1_epi32(static_cast<int>(v >> 24)),
                                    _mm_set1_epi32(static_cast<int>(v & 0xFFFFFF)));
    return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18)),
                            _mm256_set1_epi32(63));
  } else {
    // 2, 3 and 4 bits: the eight values fit in one 32-bit word.
    uint32_t v = 0;
    __builtin_memcpy(&v, row + k / 8 * BITS, BITS);
    const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(v)), shifts),
                            _mm256_set1_epi32((1 << BITS) - 1));
  }
}

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weight rows n..n+NR against x rows m..m+R.
template <int BITS, int NR, int R>
void tile(const Problem& p, int n, int m) {
  const int groups = p.K / p.group;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const float* x = p.x + static_cast<size_t>(m) * p.K;
  __m256 acc[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    __m256 s[NR], b[NR];
    for (int j = 0; j < NR; ++j) {
      size_t at = static_cast<size_t>(n + j) * groups + g;
      s[j] = _mm256_set1_ps(scale_at(p.st, p.scales, at));
      b[j] = _mm256_set1_ps(scale_at(p.st, p.biases, at));
    }
    for (int k = g * p.group; k < (g + 1) * p.group; k += 8) {
      __m256 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + static_cast<size_t>(r) * p.K + k);
      for (int j = 0; j < NR; ++j) {
        __m256 q = _mm256_cvtepi32_ps(unpack8<BITS>(p.w + (n + j) * row_bytes, k));
        __m256 w = _mm256_fmadd_ps(q, s[j], b[j]);
        for (int r = 0; r < R; ++r) acc[j][r] = _mm256_fmadd_ps(w, xv[r], acc[j][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) p.out[static_cast<size_t>(m + r) * p.N + n + j] = hsum(acc[j][r]);
}

// NR * R accumulators: four independent FMA chains at least, at most
// eight, so that they stay in registers.
template <int BITS, int R>
void rows(const Problem& p, int n0, int n1, int m) {
  constexpr int NR = R == 1 ? 4 : R == 2 ? 2 : 1;
  int n = n0;
  for (; n + NR <= n1; n += NR) tile<BITS, NR, R>(p, n, m);
  for (; n < n1; ++n) tile<BITS, 1, R>(p, n, m);
}

template <int BITS>
void run_bits(const Problem& p, int n0, int n1) {
  // Blocks of 64 weight rows for every x row, so that a block stays in the
  // cache while the x rows pass over it.
  for (int nb = n0; nb < n1; nb += 64) {
    int ne = nb + 64 < n1 ? nb + 64 : n1;
    int m = 0;
    for (; m + 4 <= p.M; m += 4) rows<BITS, 4>(p, nb, ne, m);
    switch (p.M - m) {
      case 3: rows<BITS, 3>(p, nb, ne, m); break;
      case 2: rows<BITS, 2>(p, nb, ne, m); break;
      case 1: rows<BITS, 1>(p, nb, ne, m); break;
      default: break;
    }
  }
}

}  // namespace

void run_avx2(const Problem& p, int n0, int n1) {
  switch (p.bits) {
    case 2: return run_bits<2>(p, n0, n1);
    case 3: return run_bits<3>(p, n0, n1);
    case 4: return run_bits<4>(p, n0, n1);
    case 6: return run_bits<6>(p, n0, n1);
    case 8: return run_bits<8>(p, n0, n1);
    default: return run_scalar(p, n0, n1);
  }
}

}  // namespace moat::qmm

#pragma GCC pop_options
#endif
