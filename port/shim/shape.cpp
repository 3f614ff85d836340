// Shape and type ops.
#include "shim_core.hpp"

using namespace moat;

extern "C" {

int moat_astype(const moat_array* a, int dtype, moat_array** out) {
  return produce(out, [&] { return mx::astype(arr(a), to_dtype(dtype)); });
}

int moat_contiguous(const moat_array* a, moat_array** out) {
  return produce(out, [&] { return mx::contiguous(arr(a)); });
}

int moat_reshape(const moat_array* a, const int32_t* shape, size_t ndim, moat_array** out) {
  return produce(out, [&] { return mx::reshape(arr(a), to_shape(shape, ndim)); });
}

int moat_broadcast_to(const moat_array* a, const int32_t* shape, size_t ndim, moat_array** out) {
  return produce(out, [&] { return mx::broadcast_to(arr(a), to_shape(shape, ndim)); });
}

}  // extern "C"
