// The shim's own CPU kernels (kernels_*.cpp), behind a plain C interface so
// that the AVX2 translation unit includes no C++ library headers: inline
// functions compiled there for AVX2 must not be merged into code that runs
// on other CPUs.
#pragma once
#include <stddef.h>

namespace moat::kernels {

// The element-wise functions, in the order of moat_kernel_op (moat_shim.h).
enum Op {
  EXP, EXPM1, LOG, LOG1P, TANH, SIGMOID, ERF, ERFC, SIN, COS, RSQRT, POW,
  OP_COUNT,
  // POW with one exponent for all elements (b points to it): an integer one
  // up to 64 in magnitude is computed by multiplying in f64.
  POW_SCALAR = OP_COUNT,
};

// How elements are stored; all are computed in f32.
enum Storage { F32, F16, BF16 };

// out[i] = op(a[i]) (or op(a[i], b[i]) for POW, op(a[i], b[0]) for
// POW_SCALAR) over n elements. out may alias a or b.
using Kernel = void (*)(Op op, Storage st, const void* a, const void* b, void* out, size_t n);

void run_scalar(Op op, Storage st, const void* a, const void* b, void* out, size_t n);
#if defined(__x86_64__)
// Only on a CPU with AVX2, FMA and F16C.
void run_avx2(Op op, Storage st, const void* a, const void* b, void* out, size_t n);
// Only on a CPU with AVX-512F (and the above).
void run_avx512(Op op, Storage st, const void* a, const void* b, void* out, size_t n);
#endif

// One-pass row kernels (kernels_rows.inc, kernels_scalar.cpp), per set.
// Elements are `Storage`; arithmetic is f32; strides count elements.
struct Rows {
  // out = round(x * rsqrt(mean(x^2) + eps)) * w over one row of n (w may be
  // null), rounding to the storage type after the normalization and after
  // the weight, as MLX's composition does.
  void (*rms_norm)(Storage st, const void* x, const void* w, void* out, size_t n, float eps);
  // Attention of `rows` query rows (d apart at q) that share one key/value
  // head (k: keys d apart, v: values dv apart): row r's out[r * dv ..) =
  // sum_j softmax_j(scale * q_r.k_j, with sinks[r]'s logit in the
  // denominator when sinks is not null) v_j over keys [lo[r], hi[r]); an
  // empty range gives 0. scratch holds attend_scratch(rows, dv) floats.
  void (*attend)(Storage st, const void* q, size_t rows, const void* k, const void* v, size_t d, size_t dv,
                 const size_t* lo, const size_t* hi, float scale, const float* sinks, float* scratch, void* out);
  // sum_i a[i] * b[i] over n elements, in f32 (matvec.cpp's rows of x . w^T).
  float (*dot)(Storage st, const void* a, const void* b, size_t n);
  // acc[i] += a * x[i] over n elements (matvec.cpp's rows of x . w).
  void (*axpy)(Storage st, float a, const void* x, float* acc, size_t n);
};

// Keys per block of Rows::attend (a multiple of every set's lanes).
constexpr size_t ATTEND_BLOCK = 64;
inline size_t attend_scratch(size_t rows, size_t dv) { return rows * (ATTEND_BLOCK + dv + 2); }

// The selected set's row kernels, or null when MLX's own kernels are to run
// (MOAT_CPU_FEATURES=mlx, or the default device is not the CPU).
const Rows* cpu_rows();

extern const Rows rows_scalar;
#if defined(__x86_64__)
extern const Rows rows_avx2;
extern const Rows rows_avx512;
#endif

}  // namespace moat::kernels
