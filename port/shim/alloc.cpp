// Large CPU buffers in memory files, so that a readback can hand the client
// the tensor's own pages instead of a copy (protocol.md §6, "Zero-copy
// readback"; docs/latency.md, "Zero-copy readbacks").
//
// MLX's code calls `mlx::core::allocator::allocator()` through libmlx's PLT
// (one JUMP_SLOT relocation, 323 call sites in MLX 0.32.4, and no direct
// call of CommonAllocator's methods), so the definition below, exported from
// the executable (build.rs), is the one every MLX allocation goes through.
// On MLX's no-GPU build (the original allocator is `CommonAllocator`: its
// type name says so) it returns a wrapper: buffers of at least
// `kFileBytes` are memfds mapped shared, with the 8-byte size header of
// CommonAllocator's layout (`Buffer::raw_ptr()`, libmlx's, is the pointer
// plus 8), tracked here; smaller ones go to the original. Any other build
// (CUDA) gets the original object untouched.
//
// `moat_array_export` makes a buffer's file immutable for good: its mapping
// is replaced, at the same address and over the same pages, by a read-only
// one, and the file is sealed against writes, shrinking and growing. The
// worker keeps a reference to the buffer's data (`g_exported`) so that MLX
// never donates it to an op's output (`array::is_donatable()` wants a single
// holder); `moat_exports_sweep` drops the references nothing else shares,
// which frees those buffers. A freed exported buffer is unmapped and its
// file closed, never reused; a freed unexported one is kept for reuse within
// the cache limit, as MLX keeps its own freed buffers.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "shim_core.hpp"

using namespace moat;
namespace alloc = mlx::core::allocator;

namespace {

// The shared-memory threshold (Moat.Worker's default): smaller buffers stay
// with MLX's allocator. One constant with protocol.md's pin threshold.
constexpr size_t kFileBytes = size_t(1) << 20;
// Memory files open at most for buffers; past it, buffers come from MLX's
// allocator (far below the descriptor limit, beside shared.rs's files).
constexpr size_t kMaxFiles = 8192;
constexpr size_t kHeader = sizeof(size_t);

struct File {
  int fd;
  size_t len;  // the file's size and the mapping's length (whole pages)
  bool exported;
  bool sealed;
};

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

class FileAllocator final : public alloc::Allocator {
 public:
  explicit FileAllocator(alloc::Allocator& base) : base_(base), cache_limit_(mx::get_memory_limit()) {}

  alloc::Buffer malloc(size_t size) override {
    if (size < kFileBytes) return noted(base_.malloc(size));
    size_t need = round_up(size + kHeader);
    void* base = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      base = reuse(need);
      if (base == nullptr && files_.size() + cached_.size() >= kMaxFiles) {
        return noted(base_.malloc(size));
      }
    }
    if (base == nullptr) {
      base = fresh(need);
      if (base == nullptr) {
        // No file (descriptors, memory): MLX's allocator may still have room.
        return noted(base_.malloc(size));
      }
      *static_cast<size_t*>(base) = size;
    }
    // Counted as MLX counts its own buffers: the size in the header (a
    // reused buffer keeps its own, at least `size`), not the whole pages.
    live_.fetch_add(*static_cast<size_t*>(base), std::memory_order_acq_rel);
    return noted(alloc::Buffer{base});
  }

  void free(alloc::Buffer buffer) override {
    void* base = buffer.ptr();
    File file{};
    bool ours = false;
    if (base != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = files_.find(base);
      if (it != files_.end()) {
        ours = true;
        file = it->second;
        files_.erase(it);
        size_t counted = *static_cast<const size_t*>(base);
        live_.fetch_sub(counted, std::memory_order_acq_rel);
        if (!file.exported && cached_bytes_ + counted <= cache_limit_) {
          cached_.emplace(file.len, Cached{base, file.fd, file.len, counted});
          cached_bytes_ += counted;
          return;
        }
      }
    }
    if (!ours) return base_.free(buffer);
    if (file.exported) {
      // Freeing its pages (the VM's mapping may be gone already) takes
      // milliseconds for tens of MiB: not on the thread that frees it, which
      // serves the next request.
      reap(Cached{base, file.fd, file.len});
      return;
    }
    unmap(base, file.len, file.fd);
  }

  size_t size(alloc::Buffer buffer) const override {
    if (buffer.ptr() == nullptr) return 0;
    return *static_cast<const size_t*>(buffer.ptr());
  }

  alloc::Buffer make_buffer(void* ptr, size_t size) override { return base_.make_buffer(ptr, size); }

  void release(alloc::Buffer buffer) override { base_.release(buffer); }

  size_t live() const { return live_.load(std::memory_order_acquire); }

  size_t cached() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_bytes_;
  }

  size_t peak() const { return peak_.load(std::memory_order_acquire); }

  void reset_peak() { peak_.store(0, std::memory_order_release); }

  void set_cache_limit(size_t limit) {
    std::vector<Cached> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cache_limit_ = limit;
      trim(limit, drop);
    }
    for (auto& c : drop) unmap(c.base, c.len, c.fd);
  }

  void clear_cache() { trim_to(0); }

  // The file holding [data, data + bytes), made immutable; false when no
  // file of this allocator holds those bytes. Throws when a step fails.
  bool export_range(const void* data, size_t bytes, bool seal, int* fd, size_t* file_len, size_t* offset) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = files_.upper_bound(const_cast<void*>(data));
    if (it == files_.begin()) return false;
    --it;
    auto start = static_cast<const char*>(it->first);
    auto at = static_cast<const char*>(data);
    File& file = it->second;
    if (at < start + kHeader || bytes > file.len || size_t(at - start) > file.len - bytes) return false;
    if (!file.exported) {
      // The same pages, read-only, at the same address: MLX's pointers stay
      // valid, and no writable mapping of the file is left to refuse the seal.
      // Mapped through a read-only descriptor: a shared mapping of one open
      // for writing may be made writable later, and counts as writable for
      // the seal (EBUSY).
      char path[64];
      std::snprintf(path, sizeof(path), "/proc/self/fd/%d", file.fd);
      int ro = open(path, O_RDONLY | O_CLOEXEC);
      if (ro < 0) throw std::runtime_error(std::string("cannot reopen a buffer's file: ") + strerror(errno));
      void* again = mmap(it->first, file.len, PROT_READ, MAP_SHARED | MAP_FIXED, ro, 0);
      int map_errno = errno;
      close(ro);
      if (again == MAP_FAILED) {
        // MAP_FIXED may have unmapped the old pages already: the buffer's
        // memory is gone, and MLX would fault on it. Nothing safe is left.
        std::fprintf(stderr, "moat: cannot map a buffer read-only in place: %s\n", strerror(map_errno));
        std::abort();
      }
      // From here the buffer is never reused, even if sealing fails.
      file.exported = true;
    }
    if (seal && !file.sealed) {
      if (fcntl(file.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
        throw std::runtime_error(std::string("cannot seal a buffer's file: ") + strerror(errno));
      }
      file.sealed = true;
    }
    *fd = file.fd;
    *file_len = file.len;
    *offset = size_t(at - start);
    return true;
  }

  size_t files() {
    std::lock_guard<std::mutex> lock(mutex_);
    return files_.size() + cached_.size();
  }

 private:
  struct Cached {
    void* base;
    int fd;
    size_t len = 0;
    size_t size = 0;  // the header's size: what it counts as
  };

  static size_t round_up(size_t n) { return (n + page_size() - 1) / page_size() * page_size(); }

  // Counts a new live buffer into the combined peak (MLX's peak counts only
  // its own buffers).
  alloc::Buffer noted(alloc::Buffer buffer) {
    size_t total = mx::get_active_memory() + live();
    size_t seen = peak_.load(std::memory_order_acquire);
    while (total > seen && !peak_.compare_exchange_weak(seen, total, std::memory_order_acq_rel)) {
    }
    return buffer;
  }

  // A cached file of `need` to twice `need` bytes, as MLX's buffer cache
  // picks (under the lock).
  void* reuse(size_t need) {
    auto it = cached_.lower_bound(need);
    if (it == cached_.end() || it->first > std::max(need + 2 * page_size(), 2 * need)) return nullptr;
    Cached c = it->second;
    cached_.erase(it);
    cached_bytes_ -= c.size;
    files_.emplace(c.base, File{c.fd, c.len, false, false});
    return c.base;
  }

  void* fresh(size_t len) {
    int fd = memfd_create("moat-buffer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return nullptr;
    if (ftruncate(fd, static_cast<off_t>(len)) != 0) {
      close(fd);
      return nullptr;
    }
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      close(fd);
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    files_.emplace(base, File{fd, len, false, false});
    return base;
  }

  static void unmap(void* base, size_t len, int fd) {
    munmap(base, len);
    close(fd);
  }

  // Hands an exported buffer to the reaper thread, which unmaps it and
  // closes its file; inline where no thread starts.
  void reap(Cached c) {
    {
      std::lock_guard<std::mutex> lock(reap_lock_);
      if (!reaper_started_) {
        reaper_started_ = true;
        try {
          std::thread([this] { reaper(); }).detach();
          reaper_running_ = true;
        } catch (...) {
        }
      }
      if (reaper_running_) {
        reaping_.push_back(c);
        reap_ready_.notify_one();
        return;
      }
    }
    unmap(c.base, c.len, c.fd);
  }

  void reaper() {
    // At the normal priority: a reaper at the lowest one, preempted while
    // it unmaps (holding the process's mmap lock), held the session thread
    // up for milliseconds (docs/latency.md, "Zero-copy readbacks").
    std::unique_lock<std::mutex> lock(reap_lock_);
    for (;;) {
      reap_ready_.wait(lock, [this] { return !reaping_.empty(); });
      std::vector<Cached> batch;
      batch.swap(reaping_);
      lock.unlock();
      for (auto& c : batch) unmap(c.base, c.len, c.fd);
      lock.lock();
    }
  }

  void trim_to(size_t to) {
    std::vector<Cached> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      trim(to, drop);
    }
    for (auto& c : drop) unmap(c.base, c.len, c.fd);
  }

  // Takes cached files out until at most `to` bytes stay (under the lock).
  void trim(size_t to, std::vector<Cached>& drop) {
    while (cached_bytes_ > to && !cached_.empty()) {
      auto it = cached_.begin();
      Cached c = it->second;
      cached_bytes_ -= c.size;
      cached_.erase(it);
      drop.push_back(c);
    }
  }

  alloc::Allocator& base_;
  std::mutex mutex_;
  std::map<void*, File> files_;
  std::multimap<size_t, Cached> cached_;
  size_t cached_bytes_ = 0;
  size_t cache_limit_;
  std::atomic<size_t> live_{0};
  std::atomic<size_t> peak_{0};
  std::mutex reap_lock_;
  std::condition_variable reap_ready_;
  std::vector<Cached> reaping_;
  bool reaper_started_ = false;
  bool reaper_running_ = false;
};

FileAllocator* g_files = nullptr;

alloc::Allocator& choose() {
  using Fn = alloc::Allocator& (*)();
  auto original = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "_ZN3mlx4core9allocator9allocatorEv"));
  if (original == nullptr) {
    std::fprintf(stderr, "moat: MLX's allocator() not found after the worker's (%s)\n", dlerror());
    std::abort();
  }
  alloc::Allocator& base = original();
  const char* off = std::getenv("MOAT_BUFFER_FILES");
  bool wanted = off == nullptr || std::strcmp(off, "0") != 0;
  // Only MLX's CPU allocator: its buffers are malloc'd with the 8-byte size
  // header that libmlx's Buffer::raw_ptr() skips. A GPU build's allocator
  // is left exactly as it is.
  if (wanted && std::strcmp(typeid(base).name(), "N3mlx4core9allocator15CommonAllocatorE") == 0) {
    // Never destroyed: MLX may free buffers while the process exits.
    g_files = new FileAllocator(base);
    return *g_files;
  }
  return base;
}

std::mutex g_exported_lock;
std::vector<std::shared_ptr<mx::array::Data>> g_exported;

// Keeps a reference to the array's data until `moat_exports_sweep` finds it
// the only one left: MLX then never donates the buffer to an op's output.
void hold(const mx::array& x) {
  std::lock_guard<std::mutex> lock(g_exported_lock);
  auto& data = x.data_shared_ptr();
  bool held = std::any_of(g_exported.begin(), g_exported.end(), [&](auto& d) { return d == data; });
  if (!held) g_exported.push_back(data);
}

}  // namespace

namespace mlx::core::allocator {

Allocator& allocator() {
  static Allocator& chosen = choose();
  return chosen;
}

}  // namespace mlx::core::allocator

extern "C" {

size_t moat_buffer_files_live(void) {
  mx::allocator::allocator();
  return g_files ? g_files->live() : 0;
}

size_t moat_buffer_files_cached(void) {
  mx::allocator::allocator();
  return g_files ? g_files->cached() : 0;
}

size_t moat_buffer_files_peak(void) {
  mx::allocator::allocator();
  return g_files ? g_files->peak() : 0;
}

size_t moat_buffer_files_open(void) {
  mx::allocator::allocator();
  return g_files ? g_files->files() : 0;
}

void moat_buffer_files_reset_peak(void) {
  if (g_files) g_files->reset_peak();
}

void moat_buffer_files_cache_limit(size_t limit) {
  mx::allocator::allocator();
  if (g_files) g_files->set_cache_limit(limit);
}

void moat_buffer_files_clear_cache(void) {
  if (g_files) g_files->clear_cache();
}

int moat_array_export(const moat_array* a, int seal, moat_export* out) {
  out->fd = -1;
  return guard([&] {
    const mx::array& x = arr(a);
    if (g_files == nullptr || !x.is_available() || x.data_shared_ptr() == nullptr || !x.flags().row_contiguous) {
      return;
    }
    int fd = -1;
    size_t len = 0, offset = 0;
    if (!g_files->export_range(x.data<char>(), x.nbytes(), seal != 0, &fd, &len, &offset)) return;
    hold(x);
    out->fd = fd;
    out->file_bytes = len;
    out->offset = offset;
  });
}

int moat_array_hold(const moat_array* a) {
  return guard([&] {
    if (arr(a).data_shared_ptr() != nullptr) hold(arr(a));
  });
}

size_t moat_exports_sweep(void) {
  std::vector<std::shared_ptr<mx::array::Data>> last;
  size_t left = 0;
  {
    std::lock_guard<std::mutex> lock(g_exported_lock);
    auto keep = std::partition(g_exported.begin(), g_exported.end(), [](auto& d) { return d.use_count() > 1; });
    std::move(keep, g_exported.end(), std::back_inserter(last));
    g_exported.erase(keep, g_exported.end());
    left = g_exported.size();
  }
  // The buffers are freed here, outside the list's lock.
  last.clear();
  return left;
}

}  // extern "C"
