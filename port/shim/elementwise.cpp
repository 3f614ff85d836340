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
MOAT_BINARY(power)
MOAT_BINARY(arctan2)
MOAT_BINARY(minimum)
MOAT_BINARY(maximum)
MOAT_BINARY(bitwise_and)
MOAT_BINARY(bitwise_or)
MOAT_BINARY(bitwise_xor)
MOAT_BINARY(left_shift)
MOAT_BINARY(right_shift)
MOAT_BINARY(equal)
MOAT_BINARY(not_equal)
MOAT_BINARY(greater)
MOAT_BINARY(less)
MOAT_BINARY(greater_equal)
MOAT_BINARY(less_equal)
MOAT_BINARY(logical_and)
MOAT_BINARY(logical_or)

MOAT_UNARY(exp)
MOAT_UNARY(expm1)
MOAT_UNARY(log)
MOAT_UNARY(log1p)
MOAT_UNARY(sigmoid)
MOAT_UNARY(cos)
MOAT_UNARY(sin)
MOAT_UNARY(tan)
MOAT_UNARY(cosh)
MOAT_UNARY(sinh)
MOAT_UNARY(tanh)
MOAT_UNARY(arccos)
MOAT_UNARY(arcsin)
MOAT_UNARY(arctan)
MOAT_UNARY(arccosh)
MOAT_UNARY(arcsinh)
MOAT_UNARY(arctanh)
MOAT_UNARY(sqrt)
MOAT_UNARY(rsqrt)
MOAT_UNARY(erf)
MOAT_UNARY(erfinv)
MOAT_UNARY(abs)
MOAT_UNARY(bitwise_invert)
MOAT_UNARY(ceil)
MOAT_UNARY(floor)
MOAT_UNARY(trunc)
MOAT_UNARY(conjugate)
MOAT_UNARY(negative)
MOAT_UNARY(sign)
MOAT_UNARY(real)
MOAT_UNARY(imag)
MOAT_UNARY(isnan)
MOAT_UNARY(isinf)
MOAT_UNARY(logical_not)
MOAT_BINARY(floor_divide)
MOAT_BINARY(remainder)
MOAT_UNARY(isfinite)

}  // extern "C"
