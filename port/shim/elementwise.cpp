// Element-wise ops.
#include "shim_core.hpp"

using namespace moat;

#define MOAT_BINARY(name)                                                       \
  int moat_##name(const moat_array* a, const moat_array* b, moat_array** out) { \
    return produce(out, [&] { return mx::name(arr(a), arr(b)); });              \
  }

#define MOAT_UNARY(name)                                     \
  int moat_##name(const moat_array* a, moat_array** out) {   \
    return produce(out, [&] { return mx::name(arr(a)); });   \
  }

extern "C" {

MOAT_BINARY(add)
MOAT_BINARY(subtract)
MOAT_BINARY(multiply)
MOAT_BINARY(divide)

}  // extern "C"
