// Reductions over axes.
#include "shim_core.hpp"

using namespace moat;

extern "C" {

int moat_sum(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
             moat_array** out) {
  return produce(out, [&] { return mx::sum(arr(a), to_axes(axes, naxes), keepdims != 0); });
}

#define MOAT_REDUCE(name)                                                              \
  int moat_##name(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,  \
                  moat_array** out) {                                                    \
    return produce(out, [&] { return mx::name(arr(a), to_axes(axes, naxes), keepdims != 0); }); \
  }

MOAT_REDUCE(prod)
MOAT_REDUCE(max)
MOAT_REDUCE(min)
MOAT_REDUCE(any)

int moat_argmax(const moat_array* a, int axis, int keepdims, moat_array** out) {
  return produce(out, [&] { return mx::argmax(arr(a), axis, keepdims != 0); });
}

int moat_argmin(const moat_array* a, int axis, int keepdims, moat_array** out) {
  return produce(out, [&] { return mx::argmin(arr(a), axis, keepdims != 0); });
}

int moat_argsort(const moat_array* a, int axis, moat_array** out) {
  return produce(out, [&] { return mx::argsort(arr(a), axis); });
}

}  // extern "C"
