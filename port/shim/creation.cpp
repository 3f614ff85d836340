// Arrays made from nothing but a shape and a type.
#include "shim_core.hpp"

using namespace moat;

extern "C" {

int moat_full(const int32_t* shape, size_t ndim, const moat_array* value, int dtype,
              moat_array** out) {
  return produce(out, [&] { return mx::full(to_shape(shape, ndim), arr(value), to_dtype(dtype)); });
}

int moat_arange(double start, double stop, double step, int dtype, moat_array** out) {
  return produce(out, [&] { return mx::arange(start, stop, step, to_dtype(dtype)); });
}

int moat_eye(int n, int m, int k, int dtype, moat_array** out) {
  return produce(out, [&] { return mx::eye(n, m, k, to_dtype(dtype)); });
}

}  // extern "C"
