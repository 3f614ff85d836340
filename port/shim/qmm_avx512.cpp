// The quantized product with AVX-512F/BW/VL: sixteen values of a weight row
// at a time, unpacked by one variable shift of broadcast words and turned
// into floats by one table permutation (vpermps reads only an index's low
// four bits, so it also masks them: no AND and no conversion for 2, 3 and 4
// bits), multiplied into up to four rows of x. Per group, sum_k x_k (s q_k +
// b) = s * sum_k x_k q_k + b * sum_k x_k (as the AVX2 set): the scales of
// sixteen groups are loaded and widened at once, and the bias terms are one
// vector dot product of a row's biases with x's group sums. Compiled for
// those extensions by the target pragma, as qmm_avx2.cpp; called only after
// cpuid reported them.
#include "qmm.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
// GCC 12's AVX-512 intrinsics start some results from deliberately
// undefined vectors, which -Wmaybe-uninitialized reports.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

namespace moat::qmm {
namespace {

// Up to sixteen scales (or biases) from index `at` on as f32 lanes, the
// lanes past `count` zero.
__m512 load16(Scale st, const void* v, size_t at, int count) {
  const __mmask16 m = static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
  switch (st) {
    case F32: return _mm512_maskz_loadu_ps(m, static_cast<const float*>(v) + at);
    case F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(v) + at));
    case BF16: {
      __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(v) + at));
      return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
  }
  return _mm512_setzero_ps();
}

template <int BITS>
__m512 table() {
  constexpr int mask = BITS == 2 ? 3 : BITS == 3 ? 7 : 15;
  return _mm512_setr_ps(0 & mask, 1 & mask, 2 & mask, 3 & mask, 4 & mask, 5 & mask, 6 & mask, 7 & mask,
                        8 & mask, 9 & mask, 10 & mask, 11 & mask, 12 & mask, 13 & mask, 14 & mask, 15 & mask);
}

template <typename T>
T read(const uint8_t* p) {
  T v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// The sixteen values of `row` from value k on (k a multiple of 16) as f32
// lanes. Reads whole words, at most one byte past the sixteenth value (the
// weight's bytes are followed by the scales' at least). For 4 bits the
// lanes are in the order of Problem::prepared's x: lane 2j holds value j,
// lane 2j + 1 value j + 8 (one 64-bit shift per qword lane, no shuffle).
template <int BITS>
__m512 unpack16(const uint8_t* row, int k, __m512 tbl) {
  if constexpr (BITS == 8) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  } else if constexpr (BITS == 4) {
    __m512i v = _mm512_srlv_epi64(_mm512_set1_epi64(read<long long>(row + k / 2)),
                                  _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm512_permutexvar_ps(v, tbl);
  } else if constexpr (BITS == 2) {
    __m512i v = _mm512_srlv_epi32(_mm512_set1_epi32(read<int>(row + k / 4)),
                                  _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
    return _mm512_permutexvar_ps(v, tbl);
  } else if constexpr (BITS == 3) {
    // Values 0-7 from the word at byte 0, values 8-15 from the one at byte 3.
    const uint8_t* at = row + k / 8 * 3;
    __m512i v = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(read<int>(at)), _mm512_set1_epi32(read<int>(at + 3)));
    v = _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21));
    return _mm512_permutexvar_ps(v, tbl);
  } else {
    // 6 bits: four values in each three bytes; lane i takes the word at
    // byte 3 * (i / 4) of the twelve (read by a masked load, which reads no
    // byte past them), shifted by 6 * (i % 4).
    // Each 128-bit lane L gets the twelve bytes and picks bytes 3L..3L+3
    // into its four words.
    __m128i b = _mm_maskz_loadu_epi8(0x0FFF, row + k / 8 * 6);
    constexpr int c0 = 0x03020100, c1 = 0x06050403, c2 = 0x09080706, c3 = 0x0C0B0A09;
    const __m512i bytes = _mm512_setr_epi32(c0, c0, c0, c0, c1, c1, c1, c1, c2, c2, c2, c2, c3, c3, c3, c3);
    __m512i v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(b), bytes);
    v = _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18, 0, 6, 12, 18, 0, 6, 12, 18));
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(63)));
  }
}

// What prepare made: for 4 bits, x with each block of sixteen reordered as
// unpack16 reads the weight (M * K floats), then for every width the sums
// of x over each group (M * K / group floats), row by row.
size_t prepared_floats(const Problem& p) {
  const size_t rows = static_cast<size_t>(p.M);
  return (p.bits == 4 ? rows * p.K : 0) + rows * (p.K / p.group);
}

void prepare(const Problem& p, float* out) {
  const size_t all = static_cast<size_t>(p.M) * p.K;
  float* sums = out + (p.bits == 4 ? all : 0);
  if (p.bits == 4) {
    for (size_t b = 0; b < all; b += 16) {
      for (int j = 0; j < 8; ++j) {
        out[b + 2 * j] = p.x[b + j];
        out[b + 2 * j + 1] = p.x[b + j + 8];
      }
    }
  }
  for (size_t g = 0; g < all / p.group; ++g) {
    __m512 s = _mm512_setzero_ps();
    for (int k = 0; k < p.group; k += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(p.x + g * p.group + k));
    sums[g] = _mm512_reduce_add_ps(s);
  }
}

// Weight rows n..n+NR against x rows m..m+R. The loops over them are
// unrolled so that the accumulators stay in registers (GCC at -O2 keeps
// arrays indexed by a loop on the stack).
template <int BITS, int NR, int R>
void tile(const Problem& p, int n, int m) {
  const int groups = p.K / p.group;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const float* x = (BITS == 4 ? p.prepared : p.x) + static_cast<size_t>(m) * p.K;
  const float* sums = p.prepared + (BITS == 4 ? static_cast<size_t>(p.M) * p.K : 0) + static_cast<size_t>(m) * groups;
  const __m512 tbl = table<BITS>();
  const uint8_t* w[NR];
  __m512 acc[NR][R];
  #pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    w[j] = p.w + static_cast<size_t>(n + j) * row_bytes;
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  }
  for (int g0 = 0; g0 < groups; g0 += 16) {
    const int count = groups - g0 < 16 ? groups - g0 : 16;
    __m512 s[NR];
    #pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      size_t at = static_cast<size_t>(n + j) * groups + g0;
      s[j] = load16(p.st, p.scales, at, count);
      // The bias terms of these groups: b . (sums of x), lanes past count 0.
      __m512 b = load16(p.st, p.biases, at, count);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m512 xs = _mm512_maskz_loadu_ps(static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1),
                                          sums + static_cast<size_t>(r) * groups + g0);
        acc[j][r] = _mm512_fmadd_ps(b, xs, acc[j][r]);
      }
    }
    __m512i lane = _mm512_setzero_si512();
    for (int g = g0; g < g0 + count; ++g) {
      __m512 dot[NR][R];
      #pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) dot[j][r] = _mm512_setzero_ps();
      for (int k = g * p.group; k < (g + 1) * p.group; k += 16) {
        __m512 q[NR];
        #pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) q[j] = unpack16<BITS>(w[j], k, tbl);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m512 xv = _mm512_loadu_ps(x + static_cast<size_t>(r) * p.K + k);
          #pragma GCC unroll 4
          for (int j = 0; j < NR; ++j) dot[j][r] = _mm512_fmadd_ps(q[j], xv, dot[j][r]);
        }
      }
      #pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m512 sg = _mm512_permutexvar_ps(lane, s[j]);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(sg, dot[j][r], acc[j][r]);
      }
      lane = _mm512_add_epi32(lane, _mm512_set1_epi32(1));
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) p.out[static_cast<size_t>(m + r) * p.N + n + j] = _mm512_reduce_add_ps(acc[j][r]);
}

// NR * R accumulators and as many partial dots: 16 of the 32 registers,
// four weight rows sharing each x load.
template <int BITS, int R>
void rows(const Problem& p, int n0, int n1, int m) {
  constexpr int NR = 4;
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
    // Pairs of x rows against four weight rows: with four x rows a tile
    // took 1.7 times as long a row (4 × 4096 × 4096, 4-bit, one thread).
    int m = 0;
    for (; m + 2 <= p.M; m += 2) rows<BITS, 2>(p, nb, ne, m);
    if (m < p.M) rows<BITS, 1>(p, nb, ne, m);
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

const Set avx512_set = {run, prepared_floats, prepare};

}  // namespace moat::qmm

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
