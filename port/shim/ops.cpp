// Array operations: one exported function per MLX op.
#include "shim_core.hpp"

using namespace moat;

#define MOAT_BINARY(name)                                                       \
  int moat_##name(const moat_array* a, const moat_array* b, moat_array** out) { \
    return produce(out, [&] { return mx::name(arr(a), arr(b)); });              \
  }

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

MOAT_BINARY(add)
MOAT_BINARY(subtract)
MOAT_BINARY(multiply)
MOAT_BINARY(divide)
MOAT_BINARY(matmul)

int moat_sum(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
             moat_array** out) {
  return produce(out, [&] { return mx::sum(arr(a), to_axes(axes, naxes), keepdims != 0); });
}

}  // extern "C"
