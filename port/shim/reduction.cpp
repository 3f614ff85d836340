// Reductions over axes, cumulative ops and sorting.
#include "shim_core.hpp"

using namespace moat;

#define MOAT_REDUCE(name)                                                                 \
  int moat_##name(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,   \
                  moat_array** out) {                                                     \
    return produce(out, [&] { return mx::name(arr(a), to_axes(axes, naxes), keepdims != 0); }); \
  }

#define MOAT_ARG_REDUCE(name)                                                     \
  int moat_##name(const moat_array* a, int axis, int keepdims, moat_array** out) { \
    return produce(out, [&] { return mx::name(arr(a), axis, keepdims != 0); });    \
  }

#define MOAT_SCAN(name)                                                                 \
  int moat_##name(const moat_array* a, int axis, int reverse, moat_array** out) {       \
    return produce(out, [&] { return mx::name(arr(a), axis, reverse != 0, true); });    \
  }

#define MOAT_SORT(name)                                                 \
  int moat_##name(const moat_array* a, int axis, moat_array** out) {    \
    return produce(out, [&] { return mx::name(arr(a), axis); });        \
  }

extern "C" {

MOAT_REDUCE(sum)
MOAT_REDUCE(prod)
MOAT_REDUCE(max)
MOAT_REDUCE(min)
MOAT_REDUCE(all)
MOAT_REDUCE(any)

MOAT_ARG_REDUCE(argmax)
MOAT_ARG_REDUCE(argmin)

MOAT_SCAN(cumsum)
MOAT_SCAN(cumprod)
MOAT_SCAN(cummax)
MOAT_SCAN(cummin)

MOAT_SORT(sort)
MOAT_SORT(argsort)

}  // extern "C"
