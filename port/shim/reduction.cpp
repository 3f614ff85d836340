// Reductions over axes.
#include "shim_core.hpp"

using namespace moat;

extern "C" {

int moat_sum(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
             moat_array** out) {
  return produce(out, [&] { return mx::sum(arr(a), to_axes(axes, naxes), keepdims != 0); });
}

}  // extern "C"
