// Memory statistics and limits, and the graph queries the worker's own limit
// check needs (MLX's CPU allocator does not enforce the memory limit).
#include "mlx/primitives.h"
#include "shim_core.hpp"

using namespace moat;

extern "C" {

size_t moat_active_memory(void) { return mx::get_active_memory(); }

size_t moat_peak_memory(void) { return mx::get_peak_memory(); }

size_t moat_cache_memory(void) { return mx::get_cache_memory(); }

size_t moat_memory_limit(void) { return mx::get_memory_limit(); }

int moat_reset_peak_memory(void) {
  return guard([&] { mx::reset_peak_memory(); });
}

int moat_set_memory_limit(size_t limit, size_t* previous) {
  return guard([&] { *previous = mx::set_memory_limit(limit); });
}

int moat_set_cache_limit(size_t limit, size_t* previous) {
  return guard([&] { *previous = mx::set_cache_limit(limit); });
}

int moat_clear_cache(void) {
  return guard([&] { mx::clear_cache(); });
}

int moat_array_unscheduled(const moat_array* a) {
  return arr(a).status() == mx::array::Status::unscheduled ? 1 : 0;
}

int moat_array_available(const moat_array* a) { return arr(a).is_available() ? 1 : 0; }

uintptr_t moat_array_id(const moat_array* a) { return arr(a).id(); }

const char* moat_array_primitive(const moat_array* a) {
  return arr(a).has_primitive() ? arr(a).primitive().name() : nullptr;
}

size_t moat_array_num_inputs(const moat_array* a) { return arr(a).inputs().size(); }

int moat_array_input(const moat_array* a, size_t i, moat_array** out) {
  return produce(out, [&] { return mx::array(arr(a).inputs().at(i)); });
}

size_t moat_array_num_siblings(const moat_array* a) { return arr(a).siblings().size(); }

int moat_array_sibling(const moat_array* a, size_t i, moat_array** out) {
  return produce(out, [&] { return mx::array(arr(a).siblings().at(i)); });
}

}  // extern "C"
