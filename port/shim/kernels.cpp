// The shim's vectorized CPU kernels as an MLX primitive: built into the lazy
// graph like MLX's own ops, evaluated on MLX's CPU stream thread, split over
// the cores for large inputs. The kernel set (AVX2 or scalar) is chosen once
// at start from what cpuid reports.
#include <algorithm>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <thread>

#include "kernels.h"
#include "qmm.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "shim_core.hpp"

using namespace moat;
namespace k = moat::kernels;

namespace {

std::atomic<k::Kernel> selected{k::run_scalar};
std::atomic<const k::Rows*> selected_rows{&k::rows_scalar};
// MOAT_KERNELS_MLX: MLX's own kernels instead.
std::atomic<bool> use_mlx{false};

const char* const kNames[k::OP_COUNT + 1] = {
    "MoatExp", "MoatExpm1", "MoatLog", "MoatLog1p", "MoatTanh", "MoatSigmoid",
    "MoatErf", "MoatErfc", "MoatSin", "MoatCos", "MoatRsqrt", "MoatPow", "MoatPow",
};

// Elements below which one more thread costs more than it saves: a few us
// to hand blocks to a pool helper that is spinning (parallel.hpp), 20-80 us
// to wake a parked one, against ~0.4 ns (exp) to ~3 ns (erfc) an element.
size_t min_per_thread(k::Op op) {
  switch (op) {
    case k::EXP: case k::SIGMOID: case k::RSQRT: case k::SIN: case k::COS: case k::POW_SCALAR: return 1 << 16;
    default: return 1 << 14;
  }
}

void run_parallel(k::Kernel kernel, k::Op op, k::Storage st, const char* a, const char* b, char* out,
                  size_t n, size_t esize) {
  moat::parallel_blocks(n, 1 << 14, moat::threads_for(n, min_per_thread(op)), [&](size_t lo, size_t hi) {
    const char* b_part = op == k::POW_SCALAR || !b ? b : b + lo * esize;
    kernel(op, st, a + lo * esize, b_part, out + lo * esize, hi - lo);
  });
}

k::Storage storage(mx::Dtype t) {
  if (t == mx::float32) return k::F32;
  if (t == mx::float16) return k::F16;
  if (t == mx::bfloat16) return k::BF16;
  throw std::invalid_argument("[moat kernels] only float32, float16 and bfloat16 are supported");
}

class Kernel : public mx::UnaryPrimitive {
 public:
  Kernel(mx::Stream s, k::Op op) : mx::UnaryPrimitive(s), op_(op) {}

  // Inputs are contiguous (the builder ensures it) and, for POW, of one
  // layout, or the exponent is one element; the output takes the first
  // input's layout.
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& a = inputs[0];
    k::Op op = op_;
    if (op == k::POW && !(inputs[1].flags().row_contiguous && a.flags().row_contiguous)) {
      if (inputs[1].data_size() != 1) throw std::logic_error("[MoatPow] operands of different layouts");
      op = k::POW_SCALAR;
    }
    if (a.is_donatable() && a.itemsize() == out.itemsize()) {
      out.copy_shared_buffer(a);
    } else {
      out.set_data(mx::allocator::malloc(a.data_size() * out.itemsize()), a.data_size(), a.strides(),
                   a.flags());
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([kernel = selected.load(), op, st = storage(a.dtype()),
                      pa = a.data<char>(), pb = inputs.size() > 1 ? inputs[1].data<char>() : nullptr,
                      po = out.data<char>(), n = a.data_size(), esize = a.itemsize()] {
      run_parallel(kernel, op, st, pa, pb, po, n, esize);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no GPU kernel");
  }

  const char* name() const override { return kNames[op_]; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const Kernel&>(other).op_ == op_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  k::Op op_;
};

// x itself when it is known to be laid out as the kernel needs (evaluated
// and contiguous, or row-contiguous when `row` is set), else a copy that is.
mx::array laid_out(const mx::array& x, bool row, mx::Stream s) {
  if (x.status() != mx::array::Status::unscheduled &&
      (row ? x.flags().row_contiguous : x.flags().contiguous)) {
    return x;
  }
  return mx::contiguous(x, !row, s);
}

bool ours() { return mx::default_device() == mx::Device::cpu && !use_mlx.load(); }

mx::array mlx_op(k::Op op, const mx::array& x) {
  switch (op) {
    case k::EXP: return mx::exp(x);
    case k::EXPM1: return mx::expm1(x);
    case k::LOG: return mx::log(x);
    case k::LOG1P: return mx::log1p(x);
    case k::TANH: return mx::tanh(x);
    case k::SIGMOID: return mx::sigmoid(x);
    case k::ERF: return mx::erf(x);
    case k::SIN: return mx::sin(x);
    case k::COS: return mx::cos(x);
    case k::RSQRT: return mx::rsqrt(x);
    default: throw std::invalid_argument("[moat kernels] unknown unary op");
  }
}

// -- On the GPU: the same functions computed in double precision on the
// card and rounded once to f32 (then to f16 or bf16) (CUDA's own f32 atan2, exp, log… are 1 to 2 ulp
// off, which Nx's results show in the last printed digit). MLX compiles
// each kernel once (NVRTC) when it is first used.

const char* const kGpuNames[k::POW] = {
    "moat_exp", "moat_expm1", "moat_log", "moat_log1p", "moat_tanh", "moat_sigmoid",
    "moat_erf", "moat_erfc",  "moat_sin", "moat_cos",   "moat_rsqrt",
};
const char* const kGpuExprs[k::POW] = {
    "exp(a)", "expm1(a)", "log(a)", "log1p(a)", "tanh(a)", "1.0 / (1.0 + exp(-a))",
    "erf(a)", "erfc(a)",  "sin(a)", "cos(a)",   "rsqrt(a)",
};

// Whether the double-precision GPU kernel takes x: a float of `types` on a
// GPU default device, non-empty, and few enough elements for one 1-D shape.
bool gpu_kernel_takes(const mx::array& x, std::initializer_list<mx::Dtype> types) {
  return mx::default_device() == mx::Device::gpu && std::find(types.begin(), types.end(), x.dtype()) != types.end() &&
         x.size() > 0 && x.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max());
}

// y[i] = (float) expr over the flattened inputs (`a`, and `b` when there are
// two, of one shape), computed in double; the result takes `shape`.
mx::array gpu_kernel(const char* name, const char* expr, const std::vector<mx::array>& in,
                     const mx::Shape& shape) {
  const bool binary = in.size() == 2;
  std::string source =
      "const long long n = a_in_shape[0];\n"
      "for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;\n"
      "     i += (long long)blockDim.x * gridDim.x) {\n"
      "  const double a = static_cast<double>(a_in[i]);\n";
  if (binary) source += "  const double b = static_cast<double>(b_in[i]);\n";
  source += std::string("  y[i] = static_cast<float>(") + expr + ");\n}\n";
  std::vector<std::string> names = {"a_in"};
  if (binary) names.push_back("b_in");
  auto kernel = mx::fast::cuda_kernel(name, names, {"y"}, source, "", true, 0);
  const int n = static_cast<int>(in[0].size());
  std::vector<mx::array> flat;
  for (auto& x : in) flat.push_back(mx::reshape(x, {n}));
  // At most 2^24 threads; each takes every 2^24th element after its first.
  const int threads = std::min(n, 1 << 24);
  auto out = kernel(flat, {{n}}, {mx::float32}, {threads, 1, 1}, {256, 1, 1}, {}, std::nullopt, false, {});
  return mx::reshape(out[0], shape);
}

}  // namespace

const k::Rows* k::cpu_rows() { return ours() ? selected_rows.load() : nullptr; }

extern "C" {

int moat_kernels_select(int want, int* selected_out) {
  return guard([&] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
    bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
    const k::Kernel sets[] = {k::run_scalar, k::run_avx2, k::run_avx512};
    const k::Rows* row_sets[] = {&k::rows_scalar, &k::rows_avx2, &k::rows_avx512};
#else
    bool avx2 = false, avx512 = false;
    const k::Kernel sets[] = {k::run_scalar};
    const k::Rows* row_sets[] = {&k::rows_scalar};
#endif
    if (want == MOAT_KERNELS_AVX2 && !avx2) throw std::invalid_argument("this CPU lacks AVX2, FMA or F16C");
    if (want == MOAT_KERNELS_AVX512 && !avx512) throw std::invalid_argument("this CPU lacks AVX-512F");
    int best = avx512 ? MOAT_KERNELS_AVX512 : avx2 ? MOAT_KERNELS_AVX2 : MOAT_KERNELS_SCALAR;
    int got = want == MOAT_KERNELS_AUTO ? best : want;
    use_mlx.store(got == MOAT_KERNELS_MLX);
    if (got == MOAT_KERNELS_MLX) {
      selected.store(k::run_scalar);  // erfc, which MLX lacks
    } else if (got >= 0 && got < static_cast<int>(std::size(sets))) {
      selected.store(sets[got]);
      selected_rows.store(row_sets[got]);
    } else {
      throw std::invalid_argument("unknown kernel set");
    }
    moat::qmm::select(got);
    *selected_out = got;
  });
}

int moat_kernel_unary(int op, const moat_array* a, moat_array** out) {
  return produce(out, [&] {
    if (op < 0 || op >= k::POW) throw std::invalid_argument("[moat kernels] unknown unary op");
    const mx::array& x = arr(a);
    // f16 and bf16 too: MLX's CUDA kernels compute some of these in the
    // half type itself (sigmoid was 253 ulp off in f16).
    if (gpu_kernel_takes(x, {mx::float32, mx::float16, mx::bfloat16})) {
      auto wide = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32);
      auto y = gpu_kernel(kGpuNames[op], kGpuExprs[op], {wide}, x.shape());
      return x.dtype() == mx::float32 ? y : mx::astype(y, x.dtype());
    }
    // MLX has no erfc (1 - erf loses the small values): it always runs here.
    if (!ours() && op != k::ERFC) return mlx_op(static_cast<k::Op>(op), x);
    storage(x.dtype());
    auto s = mx::default_stream(mx::Device::cpu);
    auto in = laid_out(x, false, s);
    return mx::array(x.shape(), x.dtype(), std::make_shared<Kernel>(s, static_cast<k::Op>(op)), {in});
  });
}

int moat_kernel_power(const moat_array* a, const moat_array* b, moat_array** out) {
  return produce(out, [&] {
    if (!ours()) return mx::power(arr(a), arr(b));
    if (arr(a).dtype() != arr(b).dtype()) throw std::invalid_argument("[moat power] operand types differ");
    storage(arr(a).dtype());
    auto s = mx::default_stream(mx::Device::cpu);
    auto both = mx::broadcast_arrays({arr(a), arr(b)}, s);
    // One exponent stays one element (a broadcast view of it) for POW_SCALAR.
    std::vector<mx::array> in = {laid_out(both[0], true, s),
                                 arr(b).size() == 1 ? both[1] : laid_out(both[1], true, s)};
    return mx::array(both[0].shape(), both[0].dtype(), std::make_shared<Kernel>(s, k::POW), std::move(in));
  });
}

int moat_kernel_atan2(const moat_array* a, const moat_array* b, moat_array** out) {
  return produce(out, [&] {
    if (!gpu_kernel_takes(arr(a), {mx::float32}) || arr(b).dtype() != mx::float32) return mx::arctan2(arr(a), arr(b));
    auto both = mx::broadcast_arrays({arr(a), arr(b)});
    if (both[0].size() == 0) return mx::arctan2(both[0], both[1]);
    return gpu_kernel("moat_atan2", "atan2(a, b)", both, both[0].shape());
  });
}

}  // extern "C"
