// Memory statistics and limits, and the graph queries the worker's own limit
// check needs (MLX's CPU allocator does not enforce the memory limit).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "mlx/primitives.h"
#include "shim_core.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

using namespace moat;

namespace {

#if defined(__GLIBC__)
// MLX's CPU allocator is malloc. glibc's defaults give a freed buffer of a
// few MB back to the system (munmap, or trimming an arena's top) and fault
// the next one in page by page: about 500 faults for each fresh 4 MB output
// (1M f32), which on a VM at ~6 us a fault cost more than the op itself
// (exp of 1M f32: 1.2 ms with them, 0.27 ms without). Buffers up to 32 MiB
// (glibc's largest mmap threshold) therefore come from the heap, and freed
// memory stays with the process until 1 GiB of it is free at the top or
// clear_cache (malloc_trim) returns it. A threshold GLIBC_TUNABLES names
// wins (Moat.Worker sets only the per-thread cache's size there).
const bool malloc_tuned = [] {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  auto named = [&](const char* name) { return tunables != nullptr && std::strstr(tunables, name) != nullptr; };
  if (!named("glibc.malloc.mmap_threshold")) mallopt(M_MMAP_THRESHOLD, 32 << 20);
  if (!named("glibc.malloc.trim_threshold")) mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return true;
}();
#endif

}  // namespace

extern "C" {

// MLX's counters see only its own allocator's buffers; those in memory
// files (alloc.cpp) are added.
size_t moat_active_memory(void) { return mx::get_active_memory() + moat_buffer_files_live(); }

size_t moat_peak_memory(void) { return std::max(mx::get_peak_memory(), moat_buffer_files_peak()); }

size_t moat_cache_memory(void) { return mx::get_cache_memory() + moat_buffer_files_cached(); }

size_t moat_memory_limit(void) { return mx::get_memory_limit(); }

int moat_reset_peak_memory(void) {
  return guard([&] {
    mx::reset_peak_memory();
    moat_buffer_files_reset_peak();
  });
}

int moat_set_memory_limit(size_t limit, size_t* previous) {
  return guard([&] { *previous = mx::set_memory_limit(limit); });
}

int moat_set_cache_limit(size_t limit, size_t* previous) {
  return guard([&] {
    *previous = mx::set_cache_limit(limit);
    moat_buffer_files_cache_limit(limit);
  });
}

int moat_clear_cache(void) {
  return guard([&] {
    mx::clear_cache();
    moat_buffer_files_clear_cache();
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
  });
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
