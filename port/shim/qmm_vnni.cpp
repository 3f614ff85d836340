// The 4- and 8-bit quantized product with AVX-512 VNNI: the weights' codes
// stay integers and meet x through vpdpbusd (64 unsigned-byte by
// signed-byte products summed four to a 32-bit lane per instruction)
// instead of being turned into floats one lane at a time (a shift and a
// permutation, or a widening and a conversion, per sixteen values: those,
// not the FMAs, bounded the AVX-512 set).
//
// x is split exactly enough: each block of 64 values of an x row, with
// d = max|x| / 127 over the block, is a + b / 128 + c / 16384 times d with
// a, b and c integers in [-127, 127] (b and c in [-64, 64]), chosen in
// turn as the nearest to what is left, so that what is left at the end is
// at most d / 32768 = max|x| * 2.4e-7 (four f32 roundings of the block's
// largest value). The three byte dot products of a block are exact 32-bit
// integers, combined exactly as ((A << 7) + B) << 7 + C (at most 2.131e9
// for 8 bits, under 2^31), converted to f32 once (one rounding) and
// accumulated in f32 times scale and d. The split's error is bounded by the
// block's largest value, not each value's own size: an output moves by at
// most 2.4e-7 * sum over blocks of max|x| * sum|s q| (a block of values far
// below its largest loses their low bits). Measured against the scalar
// kernel at 1 x 4096 x 4096: 1.9e-6 (4 bits) and 2.3e-6 (8 bits) of the
// largest output, as the f32 kernel (1.9e-6, 2.2e-6).
//
// x blocks with a value that is not finite, or so small that d / 16384 is
// not a normal f32, and K not a multiple of 64 take the AVX-512 set's f32
// kernel for the whole product, as do the other widths. Compiled for these
// extensions by the target pragma; called only after cpuid reported them.
#include "qmm.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

namespace moat::qmm {
namespace {

// The product this set computes itself; any other goes to the AVX-512 set.
bool mine(const Problem& p) { return (p.bits == 4 && p.K % 128 == 0) || (p.bits == 8 && p.K % 64 == 0); }

// Weights per step of a row: 4 bits take 64 bytes (two x blocks) at a time.
template <int BITS>
constexpr int kStep = BITS == 4 ? 128 : 64;

// The prepared floats: [0] 1 when the integer kernel applies (0: the f32
// kernel), then the AVX-512 set's prepared floats (always made: the
// fallback and the bias terms' group sums), then per x row and step the
// three byte levels (3 * 64 bytes per 64 values, as 48 floats) and the
// sixteen lanes' d / 16384 (16 floats: the combined sums count units of
// d / 16384).
size_t head(const Problem& p) { return 16 + avx512_set.prepared_floats(p); }

size_t per_step_floats(int bits) { return bits == 4 ? 2 * 48 + 16 : 48 + 16; }

size_t prepared_floats(const Problem& p) {
  if (!mine(p)) return avx512_set.prepared_floats(p);
  const size_t steps = static_cast<size_t>(p.K) / (p.bits == 4 ? 128 : 64);
  return head(p) + static_cast<size_t>(p.M) * steps * per_step_floats(p.bits);
}

// One block of 64 x values into its three levels and its d; false when the
// block cannot be split exactly (see above).
bool split(const float* x, int8_t* la, int8_t* lb, int8_t* lc, float* d_out) {
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < 64; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float mx = _mm512_reduce_max_ps(m);
  // Not finite (NaN compares false), or too small for d / 16384 to be normal.
  if (!(mx <= 3.0e38f)) return false;
  if (mx == 0.0f) {
    for (int i = 0; i < 64; ++i) la[i] = lb[i] = lc[i] = 0;
    *d_out = 0.0f;
    return true;
  }
  if (mx < 1.0e-30f) return false;
  const float d = mx / 127.0f, d2 = d / 128.0f, d3 = d / 16384.0f;
  for (int i = 0; i < 64; ++i) {
    const float v = x[i];
    float a = __builtin_nearbyintf(v / d);
    a = a > 127.0f ? 127.0f : a < -127.0f ? -127.0f : a;
    const float r1 = __builtin_fmaf(-a, d, v);
    float b = __builtin_nearbyintf(r1 / d2);
    b = b > 127.0f ? 127.0f : b < -127.0f ? -127.0f : b;
    const float r2 = __builtin_fmaf(-b, d2, r1);
    float c = __builtin_nearbyintf(r2 / d3);
    c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
    la[i] = static_cast<int8_t>(a);
    lb[i] = static_cast<int8_t>(b);
    lc[i] = static_cast<int8_t>(c);
  }
  *d_out = d;
  return true;
}

void prepare(const Problem& p, float* out) {
  if (!mine(p)) return avx512_set.prepare(p, out);
  avx512_set.prepare(p, out + 16);
  const int step = p.bits == 4 ? 128 : 64;
  const size_t steps = static_cast<size_t>(p.K) / step;
  float* data = out + head(p);
  bool ok = true;
  for (int m = 0; m < p.M && ok; ++m) {
    const float* x = p.x + static_cast<size_t>(m) * p.K;
    for (size_t s = 0; s < steps && ok; ++s) {
      float* at = data + (static_cast<size_t>(m) * steps + s) * per_step_floats(p.bits);
      int8_t* bytes = reinterpret_cast<int8_t*>(at);
      float* dl = at + (p.bits == 4 ? 96 : 48);
      if (p.bits == 8) {
        float d;
        ok = split(x + s * 64, bytes, bytes + 64, bytes + 128, &d);
        for (int i = 0; i < 16; ++i) dl[i] = d / 16384.0f;
      } else {
        // Two x blocks per step; the level bytes follow the weight bytes:
        // half h holds the low (h = 0) or high nibbles' values (even or
        // odd) of the 128, its lanes 0-7 from x block 0 and 8-15 from
        // block 1. So each x block is split on its own (its d), then placed.
        for (int blk = 0; blk < 2 && ok; ++blk) {
          const float* xb = x + s * 128 + blk * 64;
          int8_t a[64], b[64], c[64];
          float d;
          ok = split(xb, a, b, c, &d);
          for (int j = 0; j < 32; ++j) {
            for (int h = 0; h < 2; ++h) {
              int8_t* lv = bytes + h * 192;
              lv[blk * 32 + j] = a[2 * j + h];
              lv[64 + blk * 32 + j] = b[2 * j + h];
              lv[128 + blk * 32 + j] = c[2 * j + h];
            }
          }
          for (int i = 0; i < 8; ++i) dl[blk * 8 + i] = d / 16384.0f;
        }
      }
    }
  }
  out[0] = ok ? 1.0f : 0.0f;
}

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

// Weight rows n..n+NR against x rows m..m+R.
template <int BITS, int NR, int R>
void tile(const Problem& p, int n, int m) {
  constexpr int step = kStep<BITS>;
  const int groups = p.K / p.group;
  const int steps = p.K / step;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const size_t psf = BITS == 4 ? 2 * 48 + 16 : 48 + 16;
  const float* base = p.prepared + 16;
  const float* sums = base + (BITS == 4 ? static_cast<size_t>(p.M) * p.K : 0) + static_cast<size_t>(m) * groups;
  const float* data = p.prepared + head(p) + static_cast<size_t>(m) * steps * psf;
  // Lane i of a step covers weights [i * step / 16, (i + 1) * step / 16):
  // its group within the step's first group.
  const int lanes_per_group = p.group * 16 / step;  // 4 bits: 4, 8, 16; 8 bits: 8, 16, 32
  __m512i pattern = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      __builtin_ctz(lanes_per_group > 16 ? 16 : lanes_per_group));
  if (lanes_per_group > 16) pattern = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* w[NR];
  __m512 acc[NR][R];
  #pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    w[j] = p.w + static_cast<size_t>(n + j) * row_bytes;
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  }
  // Scales and biases sixteen groups at a time, as the AVX-512 set.
  for (int g0 = 0; g0 < groups; g0 += 16) {
    const int count = groups - g0 < 16 ? groups - g0 : 16;
    __m512 s[NR];
    #pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      size_t at = static_cast<size_t>(n + j) * groups + g0;
      s[j] = load16(p.st, p.scales, at, count);
      __m512 b = load16(p.st, p.biases, at, count);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m512 xs = _mm512_maskz_loadu_ps(static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1),
                                          sums + static_cast<size_t>(r) * groups + g0);
        acc[j][r] = _mm512_fmadd_ps(b, xs, acc[j][r]);
      }
    }
    // The steps whose weights are in these groups.
    const int k0 = g0 * p.group, k1 = (g0 + count) * p.group;
    for (int k = k0; k < k1; k += step) {
      const int st = k / step;
      // The lanes' scales: group (k - k0) / group + lane's offset.
      const __m512i idx = _mm512_add_epi32(pattern, _mm512_set1_epi32((k - k0) / p.group));
      __m512i q[NR][BITS == 4 ? 2 : 1];
      #pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m512i v = _mm512_loadu_si512(w[j] + k * BITS / 8);
        if constexpr (BITS == 4) {
          q[j][0] = _mm512_and_si512(v, low4);
          q[j][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        } else {
          q[j][0] = v;
        }
      }
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* at = data + (static_cast<size_t>(r) * steps + st) * psf;
        const int8_t* lv = reinterpret_cast<const int8_t*>(at);
        const __m512 d = _mm512_loadu_ps(at + (BITS == 4 ? 96 : 48));
        __m512i t[NR];
        #pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) t[j] = _mm512_setzero_si512();
        #pragma GCC unroll 3
        for (int level = 0; level < 3; ++level) {
          #pragma GCC unroll 2
          for (int h = 0; h < (BITS == 4 ? 2 : 1); ++h) {
            const __m512i xl = _mm512_loadu_si512(lv + h * 192 + level * 64);
            #pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) t[j] = _mm512_dpbusd_epi32(t[j], q[j][h], xl);
          }
          if (level < 2) {
            #pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) t[j] = _mm512_slli_epi32(t[j], 7);
          }
        }
        #pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
          __m512 sd = _mm512_mul_ps(_mm512_permutexvar_ps(idx, s[j]), d);
          acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[j]), sd, acc[j][r]);
        }
      }
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) p.out[static_cast<size_t>(m + r) * p.N + n + j] = _mm512_reduce_add_ps(acc[j][r]);
}

template <int BITS, int R>
void rows(const Problem& p, int n0, int n1, int m) {
  constexpr int NR = 4;
  int n = n0;
  for (; n + NR <= n1; n += NR) tile<BITS, NR, R>(p, n, m);
  for (; n < n1; ++n) tile<BITS, 1, R>(p, n, m);
}

template <int BITS>
void run_bits(const Problem& p, int n0, int n1) {
  for (int nb = n0; nb < n1; nb += 64) {
    int ne = nb + 64 < n1 ? nb + 64 : n1;
    int m = 0;
    for (; m + 2 <= p.M; m += 2) rows<BITS, 2>(p, nb, ne, m);
    if (m < p.M) rows<BITS, 1>(p, nb, ne, m);
  }
}

void run(const Problem& p, int n0, int n1) {
  if (!mine(p)) return avx512_set.run(p, n0, n1);
  if (p.prepared[0] == 0.0f) {
    Problem f = p;
    f.prepared = p.prepared + 16;
    return avx512_set.run(f, n0, n1);
  }
  if (p.bits == 4) return run_bits<4>(p, n0, n1);
  return run_bits<8>(p, n0, n1);
}

}  // namespace

const Set avx512_vnni_set = {run, prepared_floats, prepare};

}  // namespace moat::qmm

#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
