// The quantized product with AVX2 + FMA (+ F16C for f16 scales): eight
// values of a weight row at a time are unpacked with shifts, converted and
// multiplied into up to four rows of x, scaled and biased once a group, for
// several weight rows at once so that the FMA chains overlap; 4 bits
// against one x row through integer dot products instead (tile4i).
// Compiled for those extensions by the target pragma, as kernels_avx2.cpp;
// called only after cpuid reported them.
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

// Eight scales or biases from index i on, as f32.
template <Scale ST>
__m256 load8(const void* p, size_t i) {
  if constexpr (ST == F32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (ST == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
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
//
// A single x row is split into integer levels (split4) instead, and the
// same bytes meet it through vpmaddubsw (tile4i): the prepared floats
// start with a flag (1: one x row, every block split), then prepare4's
// floats, then for the one row kBlockFloats per block and its group sums. From two x rows on,
// tile4's conversions serve two or four rows and it is as fast or faster
// (1 x 4096 x 4096 on Zen 2, one thread, weight in L3: 1.0 against 1.6
// ms; 2 rows: even; 4 rows: 3.7 against 3.1 ms).
constexpr size_t kHead = 8, kBlockFloats = 56;

size_t prepared_floats(const Problem& p) {
  if (p.bits != 4 || p.K % 64 != 0) return 0;
  return kHead + static_cast<size_t>(p.M) * p.K / 8 * 9 + (p.M == 1 ? p.K / 64 * kBlockFloats + p.K / p.group : 0);
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

// v to the nearest integer within [-lim, lim].
__m256 level(__m256 v, __m256 lim) {
  __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_max_ps(_mm256_min_ps(r, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
}

// One block of 64 x values into three byte levels (as qmm_vnni.cpp's
// split: x = d * (a + b / 128 + c / 16384), a in [-127, 127], b and c in
// [-64, 64]) at `out`: level l's bytes for the even values (the weight
// bytes' low nibbles) at out + 64 l, for the odd ones at out + 64 l + 32,
// then eight copies of d / 16384 (what the combined integer sums count).
// False when the block cannot be split within that bound (a value not
// finite, or d / 16384 not a normal f32).
bool split4(const float* x, float* out) {
  __m256 m = _mm256_setzero_ps();
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 64; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), abs));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  // Not finite (NaN compares false), or too small for d / 16384 to be normal.
  if (!(mx <= 3.0e38f)) return false;
  int8_t* bytes = reinterpret_cast<int8_t*>(out);
  float* dl = out + 48;
  if (mx == 0.0f) {
    for (int i = 0; i < 192; ++i) bytes[i] = 0;
    for (int i = 0; i < 8; ++i) dl[i] = 0.0f;
    return true;
  }
  if (mx < 1.0e-30f) return false;
  const float d = mx / 127.0f;
  // Products with 1 / d, not quotients (three divisions a value: 8 of the
  // 37 us of a split at K = 4096): a level rounded the other way leaves the
  // next one a remainder within its range all the same.
  const __m256 vd = _mm256_set1_ps(d), vd2 = _mm256_set1_ps(d / 128.0f), vinv = _mm256_set1_ps(1.0f / d);
  const __m256 vinv2 = _mm256_mul_ps(vinv, _mm256_set1_ps(128.0f));
  const __m256 vinv3 = _mm256_mul_ps(vinv2, _mm256_set1_ps(128.0f));
  const __m256 a_max = _mm256_set1_ps(127.0f), b_max = _mm256_set1_ps(64.0f);
  __m256i l[3][8];
  for (int i = 0; i < 8; ++i) {
    const __m256 v = _mm256_loadu_ps(x + 8 * i);
    const __m256 a = level(_mm256_mul_ps(v, vinv), a_max);
    const __m256 r1 = _mm256_fnmadd_ps(a, vd, v);
    const __m256 b = level(_mm256_mul_ps(r1, vinv2), b_max);
    const __m256 r2 = _mm256_fnmadd_ps(b, vd2, r1);
    l[0][i] = _mm256_cvtps_epi32(a);
    l[1][i] = _mm256_cvtps_epi32(b);
    l[2][i] = _mm256_cvtps_epi32(level(_mm256_mul_ps(r2, vinv3), b_max));
  }
  // To bytes with packs and shuffles, not single bytes stored (a block's
  // split took 0.24 us that way). Two packs leave values 0-3, 8-11, 16-19,
  // 24-27 of 32 in lane 0 and 4-7, 12-15, 20-23, 28-31 in lane 1: the even
  // values at even bytes. The first shuffle takes each lane's even bytes to
  // its low half; the permute puts the even values in lane 0, the odd in
  // lane 1; the second shuffle sorts them.
  const __m256i apart = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i sort = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,  //
                                        0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  for (int lv = 0; lv < 3; ++lv) {
    __m256i half[2];
    for (int h = 0; h < 2; ++h) {
      __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(l[lv][4 * h], l[lv][4 * h + 1]),
                                          _mm256_packs_epi32(l[lv][4 * h + 2], l[lv][4 * h + 3]));
      __m256i lanes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(packed, apart), 0xD8);
      half[h] = _mm256_shuffle_epi8(lanes, sort);
    }
    __m256i* to = reinterpret_cast<__m256i*>(bytes + 64 * lv);
    _mm256_storeu_si256(to, _mm256_permute2x128_si256(half[0], half[1], 0x20));
    _mm256_storeu_si256(to + 1, _mm256_permute2x128_si256(half[0], half[1], 0x31));
  }
  for (int i = 0; i < 8; ++i) dl[i] = d / 16384.0f;
  return true;
}

void prepare(const Problem& p, float* out) {
  prepare4(p, out + kHead);
  float* blocks = out + kHead + static_cast<size_t>(p.M) * p.K / 8 * 9;
  bool ok = p.M == 1;
  for (int b = 0; b < p.K && ok; b += 64) ok = split4(p.x + b, blocks + b / 64 * kBlockFloats);
  out[0] = ok ? 1.0f : 0.0f;
  if (!ok) return;
  // The group sums of x, from prepare4's sums of eight.
  const float* eights = out + kHead + p.K;
  float* group_sums = blocks + p.K / 64 * kBlockFloats;
  for (int g = 0; g < p.K / p.group; ++g) {
    float sum = 0.0f;
    for (int i = 0; i < p.group / 8; ++i) sum += eights[g * p.group / 8 + i];
    group_sums[g] = sum;
  }
}

// Lane j's scale or bias for the block of 64 from value k (k >> shift:
// the group is a power of two, and an integer division here took a sixth
// of a block's time): one group's, or for groups of 32 the first four
// lanes' and the last four's.
template <Scale ST, bool G32>
__m256 per_lane(const void* v, size_t at, int k, int shift) {
  if constexpr (G32) {
    return _mm256_set_m128(_mm_set1_ps(scale_at(ST, v, at + k / 32 + 1)), _mm_set1_ps(scale_at(ST, v, at + k / 32)));
  } else {
    return _mm256_set1_ps(scale_at(ST, v, at + (k >> shift)));
  }
}

__m256 per_lane(const Problem& p, const void* v, size_t at, int k, int shift) {
  if (p.group != 32) return _mm256_set1_ps(scale_at(p.st, v, at + (k >> shift)));
  return _mm256_set_m128(_mm_set1_ps(scale_at(p.st, v, at + k / 32 + 1)), _mm_set1_ps(scale_at(p.st, v, at + k / 32)));
}

template <int NR, int R>
void tile4(const Problem& p, int n, int m) {
  const size_t groups = p.K / p.group;
  const float* xt = p.prepared + static_cast<size_t>(m) * p.K;
  const float* sums = p.prepared + static_cast<size_t>(p.M) * p.K + static_cast<size_t>(m) * p.K / 8;
  const __m256i nibble = _mm256_set1_epi32(15);
  const int shift = __builtin_ctz(static_cast<unsigned>(p.group));
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
      __m256 s = per_lane(p, p.scales, at, k, shift), b = per_lane(p, p.biases, at, k, shift);
      for (int r = 0; r < R; ++r) {
        __m256 xs = _mm256_loadu_ps(sums + static_cast<size_t>(r) * p.K / 8 + k / 8);
        acc[j][r] = _mm256_fmadd_ps(b, xs, _mm256_fmadd_ps(s, dot[j][r], acc[j][r]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) p.out[static_cast<size_t>(m + r) * p.N + n + j] = hsum(acc[j][r]);
}

// The one x row against four weight rows through the integer levels: per
// block of 64, the low and high nibbles as bytes (one and, one shift, one
// and for 64 values, against a shift, an and and a conversion per eight in
// tile4), vpmaddubsw with each level (pairs of products of at most
// 15 * 127, no saturation), the levels combined exactly in 32 bits by
// vpmaddwd with 2^14, 2^7 and 1 (at most 2.5e8), then one conversion and
// one FMA per eight lanes. Lane l covers values 8l..8l+7, as tile4's.
template <Scale ST, bool G32>
void tile4i(const Problem& p, int n) {
  constexpr int NR = 4;
  const size_t groups = p.K / p.group;
  const int shift = __builtin_ctz(static_cast<unsigned>(p.group));
  const float* blocks = p.prepared + kHead + static_cast<size_t>(p.K) / 8 * 9;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i weight[3] = {_mm256_set1_epi16(1 << 14), _mm256_set1_epi16(1 << 7), _mm256_set1_epi16(1)};
  const uint8_t* w = p.w + static_cast<size_t>(n) * p.K / 2;
  const size_t row = p.K / 2;
  __m256 acc[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  for (int k = 0; k < p.K; k += 64) {
    const float* blk = blocks + k / 64 * kBlockFloats;
    const __m256i* lv = reinterpret_cast<const __m256i*>(blk);
    const __m256 d = _mm256_loadu_ps(blk + 48);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row + k / 2));
      // The next tile's rows at this offset (4 rows of K / 2 bytes ahead):
      // each row is a short stream the hardware prefetcher starts late on.
      // 256 bytes ahead in the same row took a weight from DRAM, 1 x 4096 x
      // 4096 on one thread, 1.66 -> 1.43 ms; this, in the worker over 8
      // weights in turn (36 MB, past the L3), 739-767 -> 653-683 us (4 of 4
      // interleaved rounds), no change in L3. A prefetch past the weight's
      // end does not fault.
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * row + k / 2), _MM_HINT_T0);
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      __m256i t = _mm256_setzero_si256();
#pragma GCC unroll 3
      for (int l = 0; l < 3; ++l) {
        __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(lv + 2 * l)),
                                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256(lv + 2 * l + 1)));
        t = _mm256_add_epi32(t, _mm256_madd_epi16(pair, weight[l]));
      }
      __m256 s = per_lane<ST, G32>(p.scales, static_cast<size_t>(n + j) * groups, k, shift);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, d), acc[j]);
    }
  }
  // The bias terms as one dot of a row's biases with x's group sums, not
  // an FMA a block (in L2: 28 -> 25 us for 128 x 4096).
  const float* group_sums = blocks + p.K / 64 * kBlockFloats;
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    const size_t at = static_cast<size_t>(n + j) * groups;
    size_t g = 0;
    for (; g + 8 <= groups; g += 8)
      acc[j] = _mm256_fmadd_ps(load8<ST>(p.biases, at + g), _mm256_loadu_ps(group_sums + g), acc[j]);
    float rest = hsum(acc[j]);
    for (; g < groups; ++g) rest += scale_at(ST, p.biases, at + g) * group_sums[g];
    p.out[n + j] = rest;
  }
}

using Tile = void (*)(const Problem& p, int n);

Tile tile4i_for(const Problem& p) {
  const bool g32 = p.group == 32;
  switch (p.st) {
    case F16: return g32 ? tile4i<F16, true> : tile4i<F16, false>;
    case BF16: return g32 ? tile4i<BF16, true> : tile4i<BF16, false>;
    default: return g32 ? tile4i<F32, true> : tile4i<F32, false>;
  }
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

// `p` as tile4 and tile read it: prepared at prepare4's floats.
Problem for_tile4(const Problem& p) {
  Problem f = p;
  f.prepared = p.prepared + kHead;
  return f;
}

// The integer path (one x row); the last n1 - n0 mod 4 weight rows take
// tile4.
void run4i(const Problem& p, int n0, int n1) {
  const Tile tile = tile4i_for(p);
  int n = n0;
  for (; n + 4 <= n1; n += 4) tile(p, n);
  const Problem f = for_tile4(p);
  for (; n < n1; ++n) tile4<1, 1>(f, n, 0);
}

void run(const Problem& p, int n0, int n1) {
  if (p.bits == 4 && p.prepared) {
    if (p.prepared[0] != 0.0f) return run4i(p, n0, n1);
    return run_bits<4>(for_tile4(p), n0, n1);
  }
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

const Set avx2_set = {run, prepared_floats, prepare};

}  // namespace moat::qmm

#pragma GCC pop_options
#endif
