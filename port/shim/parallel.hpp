// One pool shape for the worker's own CPU kernels: up to `threads` threads
// take blocks of [0, n) from a shared counter, so that one that starts late
// (the machine is busy) takes fewer instead of holding the op up.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <thread>
#include <vector>

namespace moat {

// The threads worth having for `work` items when one more thread pays only
// from `min_per_thread` items (~20 us to start one), at most 16.
inline size_t threads_for(size_t work, size_t min_per_thread) {
  size_t cores = std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
  return std::max<size_t>(1, std::min(cores, work / min_per_thread));
}

// Runs body(lo, hi) over [0, n) in blocks of `block`, on `threads` threads.
template <typename Body>
void parallel_blocks(size_t n, size_t block, size_t threads, Body&& body) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t lo; (lo = next.fetch_add(block)) < n;) body(lo, std::min(n, lo + block));
  };
  std::vector<std::thread> helpers;
  try {
    helpers.reserve(threads - 1);
    for (size_t t = 1; t < threads; ++t) helpers.emplace_back(work);
  } catch (const std::exception&) {
    // No thread (or memory) to be had: the threads there are take its blocks.
  }
  work();
  for (auto& t : helpers) t.join();
}

}  // namespace moat
