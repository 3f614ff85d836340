// The portable quantized product: one value at a time, in f32.
#include <cstring>

#include "mlx/types/half_types.h"
#include "qmm.h"

namespace moat::qmm {
namespace {
namespace mx = mlx::core;

float scale_at(Scale st, const void* p, size_t i) {
  switch (st) {
    case F32: return static_cast<const float*>(p)[i];
    case F16: return static_cast<float>(static_cast<const mx::float16_t*>(p)[i]);
    case BF16: return static_cast<float>(static_cast<const mx::bfloat16_t*>(p)[i]);
  }
  return 0.0f;
}

// Value k of a row: `bits` bits from bit k * bits on, within two bytes
// (bits <= 8); the second byte is read only when the value reaches it.
unsigned value(const uint8_t* row, int k, int bits) {
  size_t bit = static_cast<size_t>(k) * bits;
  unsigned v = row[bit >> 3] >> (bit & 7);
  if ((bit & 7) + bits > 8) v |= static_cast<unsigned>(row[(bit >> 3) + 1]) << (8 - (bit & 7));
  return v & ((1u << bits) - 1);
}

}  // namespace

void run_scalar(const Problem& p, int n0, int n1) {
  const int groups = p.K / p.group;
  const size_t row_bytes = static_cast<size_t>(p.K) * p.bits / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * row_bytes;
    for (int m = 0; m < p.M; ++m) {
      const float* x = p.x + static_cast<size_t>(m) * p.K;
      float acc = 0.0f;
      for (int g = 0; g < groups; ++g) {
        size_t at = static_cast<size_t>(n) * groups + g;
        float s = scale_at(p.st, p.scales, at), b = scale_at(p.st, p.biases, at);
        for (int k = g * p.group; k < (g + 1) * p.group; ++k) {
          acc += (s * static_cast<float>(value(row, k, p.bits)) + b) * x[k];
        }
      }
      p.out[static_cast<size_t>(m) * p.N + n] = acc;
    }
  }
}

size_t nothing_prepared(const Problem&) { return 0; }

const Set scalar_set = {run_scalar, nothing_prepared, nullptr};

}  // namespace moat::qmm
