// Matrix products and decompositions.
#include "shim_core.hpp"

using namespace moat;

extern "C" {

int moat_matmul(const moat_array* a, const moat_array* b, moat_array** out) {
  return produce(out, [&] { return mx::matmul(arr(a), arr(b)); });
}

}  // extern "C"
