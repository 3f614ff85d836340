// The shim's quantized matrix products over MLX's affine layout
// (quant.cpp), behind a plain interface so that the AVX2 translation unit
// includes no C++ library headers (see kernels.h).
//
// Row n of the weight holds K values of `bits` bits as one little-endian
// bit stream (value k at bit k * bits of the row's bytes: MLX's layout for
// 2, 3, 4, 6 and 8 bits), then per group of `group` values one scale and
// one bias: w = scale * q + bias.
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace moat::qmm {

// How scales and biases are stored; all math is in f32.
enum Scale { F32, F16, BF16 };

struct Problem {
  const float* x;        // {M, K}, row-major
  const uint8_t* w;      // {N, K * bits / 8}, then at least 2 readable bytes
  const void* scales;    // {N, K / group}
  const void* biases;    // {N, K / group}
  float* out;            // {M, N}
  int M, N, K, bits, group;
  Scale st;
  // What the set's prepare made of x once per product, or null.
  const float* prepared = nullptr;
};

// out[m][n] = sum_k x[m][k] * (scale * q[n][k] + bias) for the output
// columns n0 <= n < n1 and every m.
using Kernel = void (*)(const Problem& p, int n0, int n1);

// A kernel set: run, after prepare (when prepared_floats is not 0) has
// filled that many floats that Problem::prepared then points at.
struct Set {
  Kernel run;
  size_t (*prepared_floats)(const Problem& p);
  void (*prepare)(const Problem& p, float* prepared);
};

void run_scalar(const Problem& p, int n0, int n1);
extern const Set scalar_set;
#if defined(__x86_64__)
// Only on a CPU with AVX2, FMA and F16C.
extern const Set avx2_set;
// Only on a CPU with AVX-512F, BW and VL (and the above).
extern const Set avx512_set;
// Only on a CPU with AVX-512 VNNI (and the above): 4 and 8 bits through
// integer dot products (qmm_vnni.cpp), the rest through avx512_set.
extern const Set avx512_vnni_set;
#endif

// Called by moat_kernels_select (kernels.cpp) with the kernel set it chose.
void select(int set);

}  // namespace moat::qmm
