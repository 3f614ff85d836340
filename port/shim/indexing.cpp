// Indexing: take, scatter and dynamic slices. MLX does not bounds-check
// indices (out-of-range reads and writes crash or corrupt memory), so the
// worker checks every index before it calls these.
#include "shim_core.hpp"

using namespace moat;

extern "C" {

int moat_take(const moat_array* a, const moat_array* indices, int axis, moat_array** out) {
  return produce(out, [&] { return mx::take(arr(a), arr(indices), axis); });
}

int moat_take_along_axis(const moat_array* a, const moat_array* indices, int axis,
                         moat_array** out) {
  return produce(out, [&] { return mx::take_along_axis(arr(a), arr(indices), axis); });
}

int moat_scatter(const moat_array* a, const moat_array* indices, const moat_array* updates,
                 int axis, moat_array** out) {
  return produce(out, [&] { return mx::scatter(arr(a), arr(indices), arr(updates), axis); });
}

int moat_scatter_add(const moat_array* a, const moat_array* indices,
                     const moat_array* updates, int axis, moat_array** out) {
  return produce(out, [&] { return mx::scatter_add(arr(a), arr(indices), arr(updates), axis); });
}

int moat_slice_dynamic(const moat_array* a, const moat_array* start, const int32_t* axes,
                       const int32_t* sizes, size_t n, moat_array** out) {
  return produce(out, [&] {
    return mx::slice(arr(a), arr(start), to_axes(axes, n), to_shape(sizes, n));
  });
}

int moat_slice_update_dynamic(const moat_array* src, const moat_array* update,
                              const moat_array* start, const int32_t* axes, size_t n,
                              moat_array** out) {
  return produce(out, [&] {
    return mx::slice_update(arr(src), arr(update), arr(start), to_axes(axes, n));
  });
}

}  // extern "C"
