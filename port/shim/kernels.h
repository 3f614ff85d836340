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

}  // namespace moat::kernels
