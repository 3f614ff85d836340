// mlx::core::fast kernels (fused on the GPU; compositions on the CPU).
// Nullable pointers are std::nullopt.
#include <optional>

#include "mlx/fast.h"
#include "shim_core.hpp"

using namespace moat;

namespace {
std::optional<mx::array> maybe(const moat_array* a) {
  return a ? std::optional<mx::array>(arr(a)) : std::nullopt;
}
}  // namespace

extern "C" {

int moat_fast_rms_norm(const moat_array* x, const moat_array* weight, float eps,
                       moat_array** out) {
  return produce(out, [&] { return mx::fast::rms_norm(arr(x), maybe(weight), eps); });
}

int moat_fast_layer_norm(const moat_array* x, const moat_array* weight, const moat_array* bias,
                         float eps, moat_array** out) {
  return produce(out,
                 [&] { return mx::fast::layer_norm(arr(x), maybe(weight), maybe(bias), eps); });
}

int moat_fast_rope(const moat_array* x, int dims, int traditional, float base, float scale,
                   int offset, const moat_array* freqs, moat_array** out) {
  return produce(out, [&] {
    std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
    return mx::fast::rope(arr(x), dims, traditional != 0, b, scale, offset, maybe(freqs));
  });
}

int moat_fast_rope_offsets(const moat_array* x, int dims, int traditional, float base,
                           float scale, const moat_array* offset, const moat_array* freqs,
                           moat_array** out) {
  return produce(out, [&] {
    std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
    return mx::fast::rope(arr(x), dims, traditional != 0, b, scale, arr(offset), maybe(freqs));
  });
}

int moat_fast_sdpa(const moat_array* q, const moat_array* k, const moat_array* v, float scale,
                   const char* mask_mode, const moat_array* mask, moat_array** out) {
  return produce(out, [&] {
    return mx::fast::scaled_dot_product_attention(arr(q), arr(k), arr(v), scale, mask_mode,
                                                  maybe(mask));
  });
}

}  // extern "C"
