// Shared by the shim's translation units: handle casts and the exception
// boundary that every exported function goes through.
#pragma once
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "moat_shim.h"

// Large CPU buffers in memory files (alloc.cpp), for memory.cpp's counters
// and limits: bytes in live ones and in freed ones kept for reuse, the
// combined peak (MLX's buffers and these), and the cache's limit.
extern "C" {
size_t moat_buffer_files_live(void);
size_t moat_buffer_files_cached(void);
size_t moat_buffer_files_peak(void);
void moat_buffer_files_reset_peak(void);
void moat_buffer_files_cache_limit(size_t limit);
void moat_buffer_files_clear_cache(void);
}

namespace moat {
namespace mx = mlx::core;

void set_error(const char* msg);

// Marks this thread as inside a synchronous evaluation while it lives: MLX's
// CPU tasks may then run inline (scheduler.cpp).
struct SyncEval {
  SyncEval();
  ~SyncEval();
  // The evaluation returned normally: the streams it signalled on hold no
  // error (MLX would have poisoned its event from one).
  void succeeded();
  SyncEval(const SyncEval&) = delete;
  SyncEval& operator=(const SyncEval&) = delete;
};

inline const mx::array& arr(const moat_array* a) {
  return *reinterpret_cast<const mx::array*>(a);
}

inline moat_array* wrap(mx::array&& a) {
  return reinterpret_cast<moat_array*>(new mx::array(std::move(a)));
}

mx::Dtype to_dtype(int code);
int from_dtype(mx::Dtype d);

inline mx::Shape to_shape(const int32_t* dims, size_t n) {
  return mx::Shape(dims, dims + n);
}

inline std::vector<int> to_axes(const int32_t* axes, size_t n) {
  return std::vector<int>(axes, axes + n);
}

inline std::vector<mx::array> to_arrays(const moat_array* const* arrays, size_t n) {
  std::vector<mx::array> v;
  v.reserve(n);
  for (size_t i = 0; i < n; ++i) v.push_back(arr(arrays[i]));
  return v;
}

// Runs f, turning any exception into an error code and message.
template <typename F>
int guard(F&& f) {
  try {
    f();
    return MOAT_OK;
  } catch (const std::bad_alloc&) {
    set_error("out of memory");
    return MOAT_ERR_ALLOC;
  } catch (const std::exception& e) {
    set_error(e.what());
    return MOAT_ERR_EXCEPTION;
  } catch (...) {
    set_error("unknown C++ exception");
    return MOAT_ERR_UNKNOWN;
  }
}

// The body of an op that yields one array.
template <typename F>
int produce(moat_array** out, F&& f) {
  return guard([&] { *out = wrap(f()); });
}

}  // namespace moat
