// The quantized product with AVX2 + FMA (+ F16C for f16 scales): eight
// values of a weight row at a time are unpacked with shifts, converted and
// multiplied into up to four rows of x, scaled and biased once a group, for
// several weight rows at once so that the FMA chains overlap. Compiled for those extensions by the target pragma, as
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
// lanes. Reads whole words, up to two bytes past the last value of the
// weight (Problem::w's bytes are followed by the scales' at least).
template <int BITS>
__m256i unpack8(const uint8_t* row, int k) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
  } else if constexpr (BITS == 6) {
    uint64_t v;
    __builtin_memcpy(&v, row + k / 8 * 6, 8);
    __m256i both = _mm256_set_m128i(_mm_set1_epi32(static_cast<int>(v >> 24)),
                                    _mm_set1_epi32(static_cast<int>(v & 0xFFFFFF)));
    return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18)),
                            _mm256_set1_epi32(63));
  } else {
    // 2, 3 and 4 bits: the eight values fit in one 32-bit word.
    uint32_t v;
    __builtin_memcpy(&v, row + k / 8 * BITS, 4);
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

// Weight rows n..n+NR against x rows m..m+R. Per group, sum_k x_k (s q_k +
// b) = s * sum_k x_k q_k + b * sum_k x_k, as ggml's Q4_1 dot product: one
// FMA a value instead of two (the sums of x are shared by the NR rows).
template <int BITS, int NR, int R>
void tile(const Problem& p, int n, int m) {
  const int groups = p.K / p.group;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const float* x = p.x + static_cast<size_t>(m) * p.K;
  const uint8_t* w[NR];
  __m256 acc[NR][R];
  for (int j = 0; j < NR; ++j) {
    w[j] = p.w + static_cast<size_t>(n + j) * row_bytes;
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  }
  for (int g = 0; g < groups; ++g) {
    __m256 dot[NR][R], xs[R];
    for (int r = 0; r < R; ++r) {
      xs[r] = _mm256_setzero_ps();
      for (int j = 0; j < NR; ++j) dot[j][r] = _mm256_setzero_ps();
    }
    for (int k = g * p.group; k < (g + 1) * p.group; k += 8) {
      __m256 q[NR];
      for (int j = 0; j < NR; ++j) q[j] = _mm256_cvtepi32_ps(unpack8<BITS>(w[j], k));
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(x + static_cast<size_t>(r) * p.K + k);
        xs[r] = _mm256_add_ps(xs[r], xv);
        for (int j = 0; j < NR; ++j) dot[j][r] = _mm256_fmadd_ps(q[j], xv, dot[j][r]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      size_t at = static_cast<size_t>(n + j) * groups + g;
      __m256 s = _mm256_set1_ps(scale_at(p.st, p.scales, at)), b = _mm256_set1_ps(scale_at(p.st, p.biases, at));
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_fmadd_ps(b, xs[r], _mm256_fmadd_ps(s, dot[j][r], acc[j][r]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) p.out[static_cast<size_t>(m + r) * p.N + n + j] = hsum(acc[j][r]);
}

// 4 bits: 32 bytes of a row are eight 32-bit lanes of eight values each,
// lane j holding values 8j..8j+7 of the block of 64. Shifting every lane by
// 4t gives values {t, 8 + t, ..., 56 + t} with no shuffle (AVX2's shuffles
// share one port, which bounded the in-order unpacking), so x is reordered
// to match once per product (prepare4): per block of 64, xt[8t + j] =
// x[8j + t], followed for all rows by the sums of x over each eight values
// (one lane's group: groups are of 32 values or more). Rows whose length
// is not a multiple of 64 take tile's path.
size_t prepared_floats(const Problem& p) {
  return p.bits == 4 && p.K % 64 == 0 ? static_cast<size_t>(p.M) * p.K / 8 * 9 : 0;
}

void prepare4(const Problem& p, float* xt) {
  const size_t all = static_cast<size_t>(p.M) * p.K;
  float* sums = xt + all;
  for (size_t b = 0; b < all; b += 64) {
    for (int j = 0; j < 8; ++j) {
      float s = 0.0f;
      for (int t = 0; t < 8; ++t) {
        xt[b + 8 * t + j] = p.x[b + 8 * j + t];
        s += p.x[b + 8 * j + t];
      }
      sums[b / 8 + j] = s;
    }
  }
}

// Lane j's scale or bias for the block of 64 from value k: one group's, or
// for groups of 32 the first four lanes' and the last four's.
__m256 per_lane(const Problem& p, const void* v, size_t at, int k) {
  if (p.group != 32) return _mm256_set1_ps(scale_at(p.st, v, at + k / p.group));
  return _mm256_set_m128(_mm_set1_ps(scale_at(p.st, v, at + k / 32 + 1)), _mm_set1_ps(scale_at(p.st, v, at + k / 32)));
}

template <int NR, int R>
void tile4(const Problem& p, int n, int m) {
  const size_t groups = p.K / p.group;
  const float* xt = p.prepared + static_cast<size_t>(m) * p.K;
  const float* sums = p.prepared + static_cast<size_t>(p.M) * p.K + static_cast<size_t>(m) * p.K / 8;
  const __m256i nibble = _mm256_set1_epi32(15);
  const uint8_t* w[NR];
  __m256 acc[NR][R];
  for (int j = 0; j < NR; ++j) {
    w[j] = p.w + static_cast<size_t>(n + j) * p.K / 2;
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  }
  for (int k = 0; k < p.K; k += 64) {
    __m256i v[NR];
    __m256 dot[NR][R];
    for (int j = 0; j < NR; ++j) {
      v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + k / 2));
      for (int r = 0; r < R; ++r) dot[j][r] = _mm256_setzero_ps();
    }
    for (int t = 0; t < 8; ++t) {
      __m256 q[NR];
      for (int j = 0; j < NR; ++j) {
        __m256i shifted = t ? _mm256_srli_epi32(v[j], 4 * t) : v[j];
        q[j] = _mm256_cvtepi32_ps(t == 7 ? shifted : _mm256_and_si256(shifted, nibble));
      }
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(xt + static_cast<size_t>(r) * p.K + k + 8 * t);
        for (int j = 0; j < NR; ++j) dot[j][r] = _mm256_fmadd_ps(q[j], xv, dot[j][r]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      size_t at = static_cast<size_t>(n + j) * groups;
      __m256 s = per_lane(p, p.scales, at, k), b = per_lane(p, p.biases, at, k);
      for (int r = 0; r < R; ++r) {
        __m256 xs = _mm256_loadu_ps(sums + static_cast<size_t>(r) * p.K / 8 + k / 8);
        acc[j][r] = _mm256_fmadd_ps(b, xs, _mm256_fmadd_ps(s, dot[j][r], acc[j][r]));
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
  if (BITS == 4 && p.prepared) {
    for (; n + NR <= n1; n += NR) tile4<NR, R>(p, n, m);
    for (; n < n1; ++n) tile4<1, R>(p, n, m);
  } else {
    for (; n + NR <= n1; n += NR) tile<BITS, NR, R>(p, n, m);
    for (; n < n1; ++n) tile<BITS, 1, R>(p, n, m);
  }
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

void run(const Problem& p, int n0, int n1) {
  switch (p.bits) {
    case 2: return run_bits<2>(p, n0, n1);
    case 3: return run_bits<3>(p, n0, n1);
    case 4: return run_bits<4>(p, n0, n1);
    case 6: return run_bits<6>(p, n0, n1);
    case 8: return run_bits<8>(p, n0, n1);
    default: return run_scalar(p, n0, n1);
  }
}

}  // namespace

const Set avx2_set = {run, prepared_floats, prepare4};

}  // namespace moat::qmm

#pragma GCC pop_options
#endif
