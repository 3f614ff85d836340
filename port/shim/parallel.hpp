// One pool shape for the worker's own CPU kernels: up to `threads` threads
// take blocks of [0, n) from a shared counter, so that one that starts late
// (the machine is busy) takes fewer instead of holding the op up.
//
// The helpers are started once and kept: after a job each spins for a short
// while (kSpinNs) before parking, so that the ops of one evaluated batch,
// which MLX's stream thread runs back to back, hand their blocks over
// through a shared counter instead of a thread start or a wake-up per op
// (on this VM a parked thread takes 20-80 us to run again).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace moat {

// The threads worth having for `work` items when one more thread pays only
// from `min_per_thread` items, at most 16.
inline size_t threads_for(size_t work, size_t min_per_thread) {
  size_t cores = std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
  return std::max<size_t>(1, std::min(cores, work / min_per_thread));
}

namespace detail {

// A job as the pool sees it: run(ctx) takes blocks until none are left.
struct Job {
  void (*run)(void* ctx);
  void* ctx;
};

class Pool {
 public:
  // How long an idle helper spins before it parks.
  static constexpr std::chrono::nanoseconds kSpinNs{200'000};

  static Pool& get() {
    // Never destroyed: helpers may still be parked at exit.
    static Pool* pool = new Pool(std::max(1u, std::min(std::thread::hardware_concurrency(), 16u)) - 1);
    return *pool;
  }

  // Runs job on the calling thread and on up to `helpers` pool threads;
  // returns once no helper can still be in it. False (nothing run) when
  // the pool is busy with another caller's job (or this is one of its
  // helpers): the caller then runs the job alone.
  bool run(Job job, size_t helpers) {
    // A job started from inside a job (either side of it) runs alone.
    if (in_job() || helpers == 0 || helpers_.empty()) return false;
    std::unique_lock<std::mutex> use(use_, std::try_to_lock);
    if (!use.owns_lock()) return false;
    job_ = job;
    wanted_.store(std::min(helpers, helpers_.size()), std::memory_order_relaxed);
    closed_.store(false, std::memory_order_seq_cst);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (parked_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(park_); }
      wake_.notify_all();
    }
    std::exception_ptr failed;
    in_job() = true;
    try {
      job.run(job.ctx);
    } catch (...) {
      failed = std::current_exception();
    }
    in_job() = false;
    // Helpers that have not entered by now will not: their blocks are done
    // (or, after a throw, abandoned). None may still hold job.ctx after this.
    closed_.store(true, std::memory_order_seq_cst);
    // A helper preempted in its block holds this up: yield now and then.
    for (unsigned spins = 0; active_.load(std::memory_order_seq_cst) != 0; ++spins) {
      if ((spins & 63) == 63) {
        std::this_thread::yield();
      } else {
        pause();
      }
    }
    if (failed) std::rethrow_exception(failed);
    return true;
  }

 private:
  explicit Pool(size_t helpers) {
    try {
      for (size_t i = 0; i < helpers; ++i) helpers_.emplace_back([this] { loop(); });
    } catch (const std::exception&) {
      // No thread to be had: the callers run their jobs alone.
    }
    for (auto& t : helpers_) t.detach();
  }

  static bool& in_job() {
    thread_local bool flag = false;
    return flag;
  }

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }

  void loop() {
    in_job() = true;
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      uint64_t g;
      for (unsigned spins = 0; (g = gen_.load(std::memory_order_acquire)) == seen; ++spins) {
        // Yielding now and then leaves the core to a thread that has work
        // (OpenBLAS's, the worker's) while this one waits for the next op.
        if ((spins & 63) == 63) {
          std::this_thread::yield();
        } else {
          pause();
        }
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() - start > kSpinNs) {
          std::unique_lock<std::mutex> lock(park_);
          parked_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
          parked_.fetch_sub(1, std::memory_order_relaxed);
          start = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      active_.fetch_add(1, std::memory_order_seq_cst);
      // A job still open (the latest: a helper that saw an older generation
      // joins the current one, which is as good) with a seat left.
      if (!closed_.load(std::memory_order_seq_cst) && take_seat()) job_.run(job_.ctx);
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  bool take_seat() {
    size_t w = wanted_.load(std::memory_order_relaxed);
    while (w > 0 && !wanted_.compare_exchange_weak(w, w - 1, std::memory_order_relaxed)) {
    }
    return w > 0;
  }

  std::mutex use_;
  Job job_{};
  std::atomic<size_t> wanted_{0};
  std::atomic<bool> closed_{true};
  std::atomic<uint64_t> gen_{0};
  std::atomic<size_t> active_{0};
  std::atomic<size_t> parked_{0};
  std::mutex park_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
};

}  // namespace detail

// Runs body(lo, hi) over [0, n) in blocks of `block`, on up to `threads`
// threads (the caller and the pool's helpers). body must not throw: on a
// helper that ends the process, as on a std::thread.
template <typename Body>
void parallel_blocks(size_t n, size_t block, size_t threads, Body&& body) {
  struct Ctx {
    std::atomic<size_t> next{0};
    size_t n, block;
    Body* body;
  } ctx;
  ctx.n = n;
  ctx.block = block;
  ctx.body = &body;
  auto work = [](void* p) {
    auto& c = *static_cast<Ctx*>(p);
    for (size_t lo; (lo = c.next.fetch_add(c.block)) < c.n;) (*c.body)(lo, std::min(c.n, lo + c.block));
  };
  if (threads > 1 && n > block && detail::Pool::get().run({work, &ctx}, threads - 1)) return;
  work(&ctx);
}

}  // namespace moat
