// The portable kernels: SLEEF's scalar functions, one element at a time.
#include <sleef.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "mlx/types/half_types.h"

namespace moat::kernels {
namespace {
namespace mx = mlx::core;

float load(Storage st, const void* p, size_t i) {
  switch (st) {
    case F32: return static_cast<const float*>(p)[i];
    case F16: return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
    case BF16: return static_cast<float>(static_cast<const mx::bfloat16_t*>(p)[i]);
  }
  return 0.0f;
}

void store(Storage st, void* p, size_t i, float v) {
  switch (st) {
    case F32: static_cast<float*>(p)[i] = v; return;
    case F16: static_cast<mx::float16_t*>(p)[i] = mx::float16_t(v); return;
    case BF16: static_cast<mx::bfloat16_t*>(p)[i] = mx::bfloat16_t(v); return;
  }
}

// As in kernels_avx2.cpp.
float sigmoid(float x) {
  float e = Sleef_expf_u10(-std::fabs(x));
  float r = 1.0f / (1.0f + e);
  return std::signbit(x) ? e * r : r;
}

// As in kernels_avx2.cpp (std::fma is exact on every CPU).
float erf(float a) {
  float t = std::fabs(a), s = a * a;
  if (t > 0.927734375f) {
    t = std::fmin(t, 4.0f);
    float r = std::fma(-1.72853470e-5f, t, 3.83197126e-4f);
    float u = std::fma(-3.88396438e-3f, t, 2.42546219e-2f);
    r = std::fma(r, t * t, u);
    r = std::fma(r, t, -1.06777877e-1f);
    r = std::fma(r, t, -6.34846687e-1f);
    r = std::fma(r, t, -1.28717512e-1f);
    r = std::fma(r, t, -t);
    return std::copysign(1.0f - Sleef_expf_u10(r), a);
  }
  float r = -5.96761703e-4f;
  r = std::fma(r, s, 4.99119423e-3f);
  r = std::fma(r, s, -2.67681349e-2f);
  r = std::fma(r, s, 1.12819925e-1f);
  r = std::fma(r, s, -3.76125336e-1f);
  r = std::fma(r, s, 1.28379166e-1f);
  return std::fma(r, a, a);
}

float apply(Op op, float x, float y) {
  switch (op) {
    case EXP: return Sleef_expf_u10(x);
    case EXPM1: return Sleef_expm1f_u10(x);
    case LOG: return Sleef_logf_u10(x);
    case LOG1P: return x > 1e38f ? Sleef_logf_u10(x) : Sleef_log1pf_u10(x);  // as in kernels_avx2.cpp
    case TANH: return Sleef_tanhf_u10(x);
    case SIGMOID: return sigmoid(x);
    case ERF: return erf(x);
    case ERFC: return Sleef_erfcf_u15(x);
    case SIN: return Sleef_sinf_u10(x);
    case COS: return Sleef_cosf_u10(x);
    case RSQRT: return 1.0f / std::sqrt(x);
    case POW: return Sleef_powf_u10(x, y);
    case POW_SCALAR: break;
  }
  return x;
}

// As kernels_simd.inc's pow_scalar.
void pow_scalar(Storage st, const void* a, const void* e, void* out, size_t n) {
  float y = load(st, e, 0);
  bool integer = y == static_cast<float>(static_cast<int>(y)) && y >= -64.0f && y <= 64.0f;
  for (size_t i = 0; i < n; ++i) {
    float x = load(st, a, i);
    store(st, out, i, integer ? static_cast<float>(std::pow(static_cast<double>(x), static_cast<int>(y)))
                              : Sleef_powf_u10(x, y));
  }
}

// v rounded to the storage type and back (MLX rounds between ops).
float rounded(Storage st, float v) {
  float t[1];
  store(st, t, 0, v);
  return load(st, t, 0);
}

float dot_row(Storage st, const void* a, const void* b, size_t n) {
  float s = 0.0f;
  for (size_t i = 0; i < n; ++i) s = std::fma(load(st, a, i), load(st, b, i), s);
  return s;
}

size_t esize(Storage st) { return st == F32 ? 4 : 2; }

void axpy_row(Storage st, float a, const void* x, float* acc, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = std::fma(a, load(st, x, i), acc[i]);
}

void rms_norm_row(Storage st, const void* x, const void* w, void* out, size_t n, float eps) {
  float r = 1.0f / std::sqrt(dot_row(st, x, x, n) / static_cast<float>(n) + eps);
  for (size_t i = 0; i < n; ++i) {
    float y = rounded(st, load(st, x, i) * r);
    store(st, out, i, w ? y * load(st, w, i) : y);
  }
}

// As kernels_rows.inc's attend_row.
void attend_row(Storage st, const void* q, const void* k, size_t ks, const void* v, size_t vs, size_t d,
                size_t dv, size_t lo, size_t hi, float scale, bool has_sink, float sink, float* scratch,
                float* acc, void* out) {
  size_t n = hi > lo ? hi - lo : 0;
  const char* kb = static_cast<const char*>(k);
  const char* vb = static_cast<const char*>(v);
  float top = has_sink ? sink : -INFINITY;
  for (size_t j = 0; j < n; ++j) {
    scratch[j] = scale * dot_row(st, q, kb + (lo + j) * ks * esize(st), d);
    top = std::fmax(top, scratch[j]);
  }
  float sum = has_sink ? Sleef_expf_u10(sink - top) : 0.0f;
  for (size_t j = 0; j < n; ++j) sum += scratch[j] = Sleef_expf_u10(scratch[j] - top);
  for (size_t i = 0; i < dv; ++i) acc[i] = 0.0f;
  for (size_t j = 0; j < n; ++j) {
    const void* vj = vb + (lo + j) * vs * esize(st);
    for (size_t i = 0; i < dv; ++i) acc[i] = std::fma(scratch[j], load(st, vj, i), acc[i]);
  }
  float inv = n ? 1.0f / sum : 0.0f;
  for (size_t i = 0; i < dv; ++i) store(st, out, i, acc[i] * inv);
}

}  // namespace

const Rows rows_scalar = {rms_norm_row, attend_row, dot_row, axpy_row};

void run_scalar(Op op, Storage st, const void* a, const void* b, void* out, size_t n) {
  if (op == POW_SCALAR) return pow_scalar(st, a, b, out, n);
  for (size_t i = 0; i < n; ++i) {
    store(st, out, i, apply(op, load(st, a, i), op == POW ? load(st, b, i) : 0.0f));
  }
}

}  // namespace moat::kernels
