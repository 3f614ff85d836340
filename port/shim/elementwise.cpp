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
MOAT_BINARY(floor_divide)
MOAT_BINARY(remainder)
MOAT_BINARY(maximum)
MOAT_BINARY(minimum)
MOAT_BINARY(equal)
MOAT_BINARY(not_equal)
MOAT_BINARY(less)
MOAT_BINARY(greater)
MOAT_BINARY(logical_and)
MOAT_BINARY(logical_or)
MOAT_BINARY(bitwise_and)
MOAT_BINARY(bitwise_or)
MOAT_BINARY(right_shift)
MOAT_BINARY(left_shift)
MOAT_UNARY(negative)
MOAT_UNARY(logical_not)
MOAT_UNARY(isfinite)
MOAT_UNARY(real)
MOAT_UNARY(imag)

}  // extern "C"
