// Products of a few rows by a matrix on the CPU: x {M, K} . w^T with w
// {N, K} (how MLX and Moat store weights), or x . w with w {K, N}. MLX's CPU
// matmul calls sgemm, which for M = 1 packs all of w into panels first
// (OpenBLAS 0.3.21: 4x a gemv's time), and converts half-float operands to
// f32 copies; at decode shapes the product is a single pass over w that
// these rows make, in w's own storage, accumulating in f32 (rounded once).
// One f32 row goes to OpenBLAS's sgemv instead, which measured faster.
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/types/half_types.h"
#include "parallel.hpp"
#include "shim_core.hpp"

using namespace moat;
namespace k = moat::kernels;

namespace {

// Up to this many rows of x: w's rows are read once from memory and from L1
// for the other rows of x.
constexpr int kMaxRows = 16;

// f32 accumulators of the {K, N} form per block, at most (64 KiB, in L2):
// a block is as wide as that allows, so that each row of w is read in long
// runs (64 columns a block, 128 bytes of a bf16 row at a stride of 8 KiB,
// cost a page walk each: 15.5 ms against the {N, K} form's 2.4 at
// 1 × 4096 × 4096 bf16).
constexpr size_t kAccFloats = 16384;
// Block widths are multiples of this.
constexpr size_t kBlock = 64;

// Measured: OpenBLAS 0.3.21 sgemv beat these rows at 1 × 4096 × 4096 (2.2-2.3 vs
// 2.5-3.0 ms) and 1 × 1024 × 4096 (0.67-0.69 vs 0.89-1.03 ms, worker call
// included, one run, EPYC Zen 4 VM with 2 vCPUs); half floats and M > 1 keep them.
constexpr bool kBlasByDefault = true;

// OpenBLAS's sgemv, found at run time: a worker built on MLX's bundled
// reference BLAS (MOAT_BLAS=bundled, or no libopenblas at build time) has no
// cblas_sgemv to link against, and keeps these rows.
using Sgemv = void (*)(int order, int trans, int m, int n, float alpha, const float* a, int lda, const float* x,
                       int incx, float beta, float* y, int incy);

// OpenBLAS's sgemv where one f32 row takes it (threaded, blocked; never a
// reference BLAS), else null; MOAT_MATVEC_BLAS=1 or 0 forces the choice
// (1 still needs OpenBLAS's).
Sgemv blas_row() {
  static const Sgemv f = [] {
    if (dlsym(RTLD_DEFAULT, "openblas_get_num_threads") == nullptr) return Sgemv{nullptr};
    const char* e = std::getenv("MOAT_MATVEC_BLAS");
    if (e != nullptr ? std::string(e) != "1" : !kBlasByDefault) return Sgemv{nullptr};
    return reinterpret_cast<Sgemv>(dlsym(RTLD_DEFAULT, "cblas_sgemv"));
  }();
  return f;
}

k::Storage storage(mx::Dtype t) { return t == mx::float32 ? k::F32 : t == mx::float16 ? k::F16 : k::BF16; }

float load(k::Storage st, const char* p) {
  switch (st) {
    case k::F32: return *reinterpret_cast<const float*>(p);
    case k::F16: return static_cast<float>(*reinterpret_cast<const mx::float16_t*>(p));
    case k::BF16: return static_cast<float>(*reinterpret_cast<const mx::bfloat16_t*>(p));
  }
  return 0.0f;
}

void store(k::Storage st, char* p, float v) {
  switch (st) {
    case k::F32: *reinterpret_cast<float*>(p) = v; return;
    case k::F16: *reinterpret_cast<mx::float16_t*>(p) = mx::float16_t(v); return;
    case k::BF16: *reinterpret_cast<mx::bfloat16_t*>(p) = mx::bfloat16_t(v); return;
  }
}

class MatVec : public mx::UnaryPrimitive {
 public:
  MatVec(mx::Stream s, const k::Rows* rows, bool transposed)
      : mx::UnaryPrimitive(s), rows_(rows), transposed_(transposed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &x = inputs[0], &w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    size_t m = x.shape(0), kk = x.shape(1), n = out.shape(1);
    encoder.dispatch([rows = rows_, transposed = transposed_, st = storage(x.dtype()), es = x.itemsize(),
                      px = x.data<char>(), pw = w.data<char>(), po = out.data<char>(), m, kk, n] {
      Sgemv sgemv = st == k::F32 && m == 1 && n > 0 && kk > 0 ? blas_row() : nullptr;
      if (sgemv != nullptr) {
        auto f = [](const char* p) { return reinterpret_cast<const float*>(p); };
        int ni = static_cast<int>(n), ki = static_cast<int>(kk);
        // Row-major (101); w {N, K}: w x (111), w {K, N}: wᵀ x (112).
        if (transposed) {
          sgemv(101, 112, ki, ni, 1.0f, f(pw), ni, f(px), 1, 0.0f, reinterpret_cast<float*>(po), 1);
        } else {
          sgemv(101, 111, ni, ki, 1.0f, f(pw), ki, f(px), 1, 0.0f, reinterpret_cast<float*>(po), 1);
        }
        return;
      }
      size_t threads = threads_for(m * n * kk, 1 << 17);
      if (transposed) {
        // w {K, N}: out[i, lo..hi) = sum_p x[i, p] w[p, lo..hi).
        size_t per_thread = (n + threads - 1) / threads;
        size_t block = std::max(kBlock, std::min(kAccFloats / m, per_thread) / kBlock * kBlock);
        parallel_blocks(n, block, threads, [&](size_t lo, size_t hi) {
          thread_local std::vector<float> buffer;
          size_t width = hi - lo;
          buffer.assign(m * width, 0.0f);
          float* acc = buffer.data();
          for (size_t p = 0; p < kk; ++p) {
            const char* row = pw + (p * n + lo) * es;
            for (size_t i = 0; i < m; ++i) rows->axpy(st, load(st, px + (i * kk + p) * es), row, acc + i * width, width);
          }
          for (size_t i = 0; i < m; ++i) {
            for (size_t j = 0; j < width; ++j) store(st, po + (i * n + lo + j) * es, acc[i * width + j]);
          }
        });
      } else {
        // w {N, K}: out[i, j] = x[i, :] . w[j, :].
        parallel_blocks(n, 16, threads, [&](size_t lo, size_t hi) {
          for (size_t j = lo; j < hi; ++j) {
            for (size_t i = 0; i < m; ++i) {
              store(st, po + (i * n + j) * es, rows->dot(st, px + i * kk * es, pw + j * kk * es, kk));
            }
          }
        });
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[MoatMatVec] has no GPU kernel");
  }

  const char* name() const override { return "MoatMatVec"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const MatVec&>(other);
    return o.rows_ == rows_ && o.transposed_ == transposed_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(transposed_ ? 1 : 0)}};
  }

 private:
  const k::Rows* rows_;
  bool transposed_;
};

}  // namespace

extern "C" {

int moat_matvec(const moat_array* x, const moat_array* w, int transposed, moat_array** out) {
  return produce(out, [&] {
    const mx::array &a = arr(x), &b = arr(w);
    if (a.ndim() != 2 || b.ndim() != 2 || a.shape(1) != b.shape(transposed ? 0 : 1)) {
      throw std::invalid_argument("matvec: expected x {M, K} and w {N, K} (or {K, N} transposed)");
    }
    const k::Rows* rows = k::cpu_rows();
    bool floating = a.dtype() == mx::float32 || a.dtype() == mx::float16 || a.dtype() == mx::bfloat16;
    if (!floating || b.dtype() != a.dtype()) throw std::invalid_argument("matvec: expected two arrays of one float type");
    if (!rows || a.shape(0) > kMaxRows) {
      // MLX's product, half floats accumulated in f32 as the worker's dot does.
      auto f32 = [&](const mx::array& t) { return mx::astype(t, mx::float32); };
      auto p = mx::matmul(f32(a), transposed ? f32(b) : mx::transpose(f32(b)));
      return mx::astype(p, a.dtype());
    }
    auto s = mx::default_stream(mx::Device::cpu);
    int n = b.shape(transposed ? 1 : 0);
    return mx::array({a.shape(0), n}, a.dtype(), std::make_shared<MatVec>(s, rows, transposed != 0),
                     {mx::contiguous(a, false, s), mx::contiguous(b, false, s)});
  });
}

}  // extern "C"
