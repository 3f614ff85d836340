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

int moat_view(const moat_array* a, int dtype, moat_array** out) {
  return produce(out, [&] { return mx::view(arr(a), to_dtype(dtype)); });
}

int moat_transpose(const moat_array* a, const int32_t* axes, size_t naxes, moat_array** out) {
  return produce(out, [&] { return mx::transpose(arr(a), to_axes(axes, naxes)); });
}

int moat_flip(const moat_array* a, const int32_t* axes, size_t naxes, moat_array** out) {
  return produce(out, [&] { return mx::flip(arr(a), to_axes(axes, naxes)); });
}

int moat_slice(const moat_array* a, const int32_t* start, const int32_t* stop,
               const int32_t* strides, size_t ndim, moat_array** out) {
  return produce(out, [&] {
    return mx::slice(arr(a), to_shape(start, ndim), to_shape(stop, ndim), to_shape(strides, ndim));
  });
}

int moat_slice_update(const moat_array* src, const moat_array* update, const int32_t* start,
                      const int32_t* stop, const int32_t* strides, size_t ndim,
                      moat_array** out) {
  return produce(out, [&] {
    return mx::slice_update(arr(src), arr(update), to_shape(start, ndim), to_shape(stop, ndim),
                            to_shape(strides, ndim));
  });
}

int moat_concatenate(const moat_array* const* arrays, size_t n, int axis, moat_array** out) {
  return produce(out, [&] { return mx::concatenate(to_arrays(arrays, n), axis); });
}

int moat_stack(const moat_array* const* arrays, size_t n, int axis, moat_array** out) {
  return produce(out, [&] { return mx::stack(to_arrays(arrays, n), axis); });
}

int moat_where(const moat_array* cond, const moat_array* a, const moat_array* b,
               moat_array** out) {
  return produce(out, [&] { return mx::where(arr(cond), arr(a), arr(b)); });
}

int moat_pad(const moat_array* a, const int32_t* low, const int32_t* high, size_t ndim,
             const moat_array* value, moat_array** out) {
  return produce(out, [&] {
    std::vector<int> axes(ndim);
    for (size_t i = 0; i < ndim; ++i) axes[i] = static_cast<int>(i);
    return mx::pad(arr(a), axes, to_shape(low, ndim), to_shape(high, ndim), arr(value));
  });
}

int moat_as_strided(const moat_array* a, const int32_t* shape, const int64_t* strides,
                    size_t ndim, size_t offset, moat_array** out) {
  return produce(out, [&] {
    return mx::as_strided(arr(a), to_shape(shape, ndim), mx::Strides(strides, strides + ndim), offset);
  });
}

int moat_tril(const moat_array* a, int k, moat_array** out) {
  return produce(out, [&] { return mx::tril(arr(a), k); });
}

int moat_diagonal(const moat_array* a, int offset, int axis1, int axis2, moat_array** out) {
  return produce(out, [&] { return mx::diagonal(arr(a), offset, axis1, axis2); });
}

}  // extern "C"
