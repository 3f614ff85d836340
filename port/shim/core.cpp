// Arrays, buffers, evaluation, devices and errors.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <variant>

#include "mlx/primitives.h"
#include "mlx/scheduler.h"
#include "shim_core.hpp"

namespace moat {

static thread_local std::string last_error;

void set_error(const char* msg) { last_error = msg; }

static const mx::Dtype kDtypes[] = {
    mx::bool_,   mx::uint8,   mx::uint16,  mx::uint32, mx::uint64,
    mx::int8,    mx::int16,   mx::int32,   mx::int64,  mx::float16,
    mx::float32, mx::float64, mx::bfloat16, mx::complex64,
};

mx::Dtype to_dtype(int code) {
  if (code < 0 || code > MOAT_C64) throw std::invalid_argument("unknown dtype code");
  return kDtypes[code];
}

int from_dtype(mx::Dtype d) { return static_cast<int>(d.val()); }

static mx::Device to_device(int device) {
  return device == MOAT_GPU ? mx::Device::gpu : mx::Device::cpu;
}

// MLX's CPU allocator tracks a buffer by a pointer to a size_t holding its
// size; the data follows (Buffer::raw_ptr() skips the header). Read off a
// real allocation: 0 when the allocator lays buffers out otherwise.
static size_t buffer_header() {
  static const size_t header = [] {
    auto& a = mx::allocator::allocator();
    auto b = a.malloc(24);
    if (b.ptr() == nullptr) return size_t{0};
    auto offset = static_cast<char*>(b.raw_ptr()) - static_cast<char*>(b.ptr());
    bool sized = offset >= static_cast<ptrdiff_t>(sizeof(size_t)) && offset <= 64 && a.size(b) == 24 &&
                 *static_cast<size_t*>(b.ptr()) == 24;
    a.free(b);
    return sized ? static_cast<size_t>(offset) : size_t{0};
  }();
  return header;
}

// Calls release(ctx) when it goes away (shared by the deleters that hold it).
class Release {
 public:
  Release(void (*release)(void*), void* ctx) : release_(release), ctx_(ctx) {}
  Release(const Release&) = delete;
  Release& operator=(const Release&) = delete;
  ~Release() { release_(ctx_); }

 private:
  void (*release_)(void*);
  void* ctx_;
};

}  // namespace moat

using namespace moat;

extern "C" {

const char* moat_last_error(void) { return last_error.c_str(); }

const char* moat_mlx_version(void) { return mx::version(); }

int moat_device_available(int device, int* out) {
  return guard([&] { *out = mx::is_available(to_device(device)) ? 1 : 0; });
}

int moat_set_default_device(int device) {
  return guard([&] { mx::set_default_device(to_device(device)); });
}

int moat_device_count(int device, int* out) {
  return guard([&] { *out = mx::device_count(to_device(device).type); });
}

int moat_device_info(int device, int index, char* name, size_t name_cap, uint64_t* memory,
                     int* cc_major, int* cc_minor) {
  return guard([&] {
    const auto& info = mx::device_info(mx::Device(to_device(device).type, index));
    auto text = [&](const char* key) {
      auto it = info.find(key);
      return it != info.end() && std::holds_alternative<std::string>(it->second)
                 ? std::get<std::string>(it->second)
                 : std::string();
    };
    auto number = [&](std::initializer_list<const char*> keys) {
      for (auto key : keys) {
        auto it = info.find(key);
        if (it != info.end() && std::holds_alternative<size_t>(it->second)) return std::get<size_t>(it->second);
      }
      return size_t{0};
    };
    std::string n = text("device_name");
    if (n.empty()) n = text("architecture");
    if (name_cap > 0) {
      size_t len = std::min(n.size(), name_cap - 1);
      std::memcpy(name, n.data(), len);
      name[len] = '\0';
    }
    *memory = number({"total_memory", "memory_size"});
    *cc_major = static_cast<int>(number({"compute_capability_major"}));
    *cc_minor = static_cast<int>(number({"compute_capability_minor"}));
  });
}

int moat_buffer_alloc(size_t nbytes, moat_buffer** out, void** data) {
  return guard([&] {
    auto d = std::make_unique<mx::allocator::Data>(mx::allocator::malloc(nbytes));
    // MLX's CPU allocator returns a null buffer instead of throwing.
    if (d->buffer().ptr() == nullptr && nbytes > 0) throw std::bad_alloc();
    *data = nbytes > 0 ? d->buffer().raw_ptr() : nullptr;
    *out = reinterpret_cast<moat_buffer*>(d.release());
  });
}

void moat_buffer_free(moat_buffer* buf) {
  delete reinterpret_cast<mx::allocator::Data*>(buf);
}

int moat_array_from_buffer(moat_buffer* buf, const int32_t* shape, size_t ndim,
                           int dtype, moat_array** out) {
  std::unique_ptr<mx::allocator::Data> data(reinterpret_cast<mx::allocator::Data*>(buf));
  return produce(out, [&] {
    return mx::array(std::move(*data), to_shape(shape, ndim), to_dtype(dtype));
  });
}

int moat_array_from_external(void* data, size_t nbytes, size_t room, const int32_t* shape, size_t ndim,
                             int dtype, void (*release)(void*), void* ctx, moat_array** out) {
  // Whatever happens below, release runs exactly once: when the array lets
  // go of the memory, or when this function returns if no array took it.
  std::shared_ptr<Release> owner;
  int rc = guard([&] { owner = std::make_shared<Release>(release, ctx); });
  if (rc != MOAT_OK) {
    release(ctx);
    return rc;
  }
  size_t header = 0;
  rc = guard([&] { header = buffer_header(); });
  if (rc != MOAT_OK) return rc;
  if (header == 0 || header > room) {
    // MLX copies the bytes into a buffer of its own.
    return produce(out, [&] {
      return mx::array(data, to_shape(shape, ndim), to_dtype(dtype), [owner](void*) {});
    });
  }
  char* base = static_cast<char*>(data) - header;
  *reinterpret_cast<size_t*>(base) = nbytes;
  return produce(out, [&] {
    mx::allocator::Data adopted(mx::allocator::Buffer{base}, [owner](mx::allocator::Buffer) {});
    return mx::array(std::move(adopted), to_shape(shape, ndim), to_dtype(dtype));
  });
}

void moat_array_free(moat_array* a) { delete reinterpret_cast<mx::array*>(a); }

int moat_array_clone(const moat_array* a, moat_array** out) {
  return produce(out, [&] { return mx::array(arr(a)); });
}

size_t moat_array_ndim(const moat_array* a) { return arr(a).ndim(); }

void moat_array_shape(const moat_array* a, int32_t* out) {
  const auto& s = arr(a).shape();
  std::copy(s.begin(), s.end(), out);
}

int moat_array_dtype(const moat_array* a) { return from_dtype(arr(a).dtype()); }

size_t moat_array_size(const moat_array* a) { return arr(a).size(); }

size_t moat_array_nbytes(const moat_array* a) { return arr(a).nbytes(); }

int moat_array_row_contiguous(const moat_array* a) {
  return arr(a).flags().row_contiguous ? 1 : 0;
}

const void* moat_array_data(const moat_array* a) { return arr(a).data<void>(); }

int moat_eval(moat_array* const* arrays, size_t n) {
  return guard([&] {
    // MLX's CPU tasks of this evaluation may run on this thread
    // (scheduler.cpp).
    SyncEval sync;
    mx::eval(to_arrays(arrays, n));
    sync.succeeded();
  });
}

int moat_async_eval(moat_array* const* arrays, size_t n) {
  return guard([&] { mx::async_eval(to_arrays(arrays, n)); });
}

namespace {
// Holds a CPU stream's thread until opened (or a millisecond passes, so that
// nothing can wait on it for longer: MLX's scheduler blocks the caller when
// too many tasks are queued).
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false;

  void wait() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, std::chrono::milliseconds(1), [this] { return open; });
  }
};

struct Opener {
  std::shared_ptr<Gate> gate;
  ~Opener() {
    {
      std::lock_guard<std::mutex> lock(gate->m);
      gate->open = true;
    }
    gate->cv.notify_one();
  }
};
}  // namespace

int moat_async_eval_gated(moat_array* const* arrays, size_t n) {
  return guard([&] {
    auto v = to_arrays(arrays, n);
    bool tracing = std::any_of(v.begin(), v.end(), [](const mx::array& a) { return a.is_tracer(); });
    if (tracing || v.empty() || !v[0].has_primitive() || v[0].primitive().stream().device != mx::Device::cpu) {
      mx::async_eval(std::move(v));
      return;
    }
    auto gate = std::make_shared<Gate>();
    mx::scheduler::enqueue(v[0].primitive().stream(), [gate] { gate->wait(); });
    Opener opener{gate};
    mx::async_eval(std::move(v));
  });
}

}  // extern "C"
