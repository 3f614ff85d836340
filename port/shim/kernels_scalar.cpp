// The portable kernels: SLEEF's scalar functions, one element at a time.
#include <sleef.h>

#include <algorithm>
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

// As kernels_rows.inc's attend_rows.
void attend_rows(Storage st, const void* q, size_t rows, const void* k, const void* v, size_t d, size_t dv,
                 const size_t* lo, const size_t* hi, float scale, const float* sinks, float* scratch, void* out) {
  constexpr size_t BK = ATTEND_BLOCK;
  const char *qb = static_cast<const char*>(q), *kb = static_cast<const char*>(k), *vb = static_cast<const char*>(v);
  size_t es = esize(st);
  float* s = scratch;
  float* m = s + rows * BK;
  float* l = m + rows;
  float* acc = l + rows;
  size_t first = SIZE_MAX, last = 0;
  for (size_t r = 0; r < rows; ++r) {
    m[r] = sinks ? sinks[r] : -INFINITY;
    l[r] = sinks ? 1.0f : 0.0f;
    for (size_t i = 0; i < dv; ++i) acc[r * dv + i] = 0.0f;
    if (lo[r] < hi[r]) first = std::min(first, lo[r]), last = std::max(last, hi[r]);
  }
  for (size_t j0 = first; j0 < last; j0 += BK) {
    size_t n = std::min(BK, last - j0);
    for (size_t r = 0; r < rows; ++r) {
      float* sr = s + r * BK;
      float t = m[r];
      for (size_t j = 0; j < n; ++j) {
        bool in = j0 + j >= lo[r] && j0 + j < hi[r];
        sr[j] = in ? scale * dot_row(st, qb + r * d * es, kb + (j0 + j) * d * es, d) : -INFINITY;
        t = std::fmax(t, sr[j]);
      }
      if (t == -INFINITY) {
        for (size_t j = 0; j < n; ++j) sr[j] = 0.0f;
        continue;
      }
      if (t > m[r]) {
        float f = Sleef_expf_u10(m[r] - t);
        l[r] *= f;
        for (size_t i = 0; i < dv; ++i) acc[r * dv + i] *= f;
        m[r] = t;
      }
      for (size_t j = 0; j < n; ++j) l[r] += sr[j] = Sleef_expf_u10(sr[j] - m[r]);
    }
    for (size_t j = 0; j < n; ++j)
      for (size_t r = 0; r < rows; ++r)
        if (s[r * BK + j] != 0.0f) axpy_row(st, s[r * BK + j], vb + (j0 + j) * dv * es, acc + r * dv, dv);
  }
  for (size_t r = 0; r < rows; ++r) {
    float inv = lo[r] < hi[r] ? 1.0f / l[r] : 0.0f;
    for (size_t i = 0; i < dv; ++i) store(st, static_cast<char*>(out) + r * dv * es, i, acc[r * dv + i] * inv);
  }
}

}  // namespace

const Rows rows_scalar = {rms_norm_row, attend_rows, dot_row, axpy_row};

void run_scalar(Op op, Storage st, const void* a, const void* b, void* out, size_t n) {
  if (op == POW_SCALAR) return pow_scalar(st, a, b, out, n);
  for (size_t i = 0; i < n; ++i) {
    store(st, out, i, apply(op, load(st, a, i), op == POW ? load(st, b, i) : 0.0f));
  }
}

}  // namespace moat::kernels
