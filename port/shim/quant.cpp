// Quantized weights: MLX's quantize, dequantize, quantized_matmul and
// gather_qmm over one packed array per weight, and the shim's own CPU
// kernel of the affine product (qmm_*.cpp) as an MLX primitive.
//
// The packed array (protocol.md, "Quantized weights") is one uint8 vector:
// MLX's three arrays of the weight, each row-major, one after the other:
// the packed words {..., out, in * bits / 32} (uint32), the scales
// {..., out, in / group} (f32, f16 or bf16 for :affine, uint8 for the
// microscaled modes) and, for :affine only, the biases (as the scales).
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>
#include <thread>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "parallel.hpp"
#include "qmm.h"
#include "shim_core.hpp"

using namespace moat;
namespace q = moat::qmm;

namespace {

std::atomic<const q::Set*> selected{&q::scalar_set};
std::atomic<bool> use_mlx{false};

struct Parts {
  mx::array w, scales;
  std::optional<mx::array> biases;
};

size_t count(const mx::Shape& s, size_t from, size_t to) {
  size_t n = 1;
  for (size_t i = from; i < to; ++i) n *= static_cast<size_t>(s[i]);
  return n;
}

std::string shape_text(const mx::Shape& s) {
  std::string t = "{";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "}";
}

// The three arrays of a packed weight of dense `shape` (affine scales and
// biases of type `scales`), as views of it.
Parts unpack(const mx::array& packed, const mx::Shape& shape, mx::Dtype scales, int group, int bits,
             const std::string& mode) {
  if (shape.size() < 2) throw std::invalid_argument("a quantized weight has rank at least 2");
  const size_t k = static_cast<size_t>(shape.back());
  if (group <= 0 || bits <= 0 || k % group != 0 || (k * bits) % 32 != 0) {
    throw std::invalid_argument("the last axis of " + shape_text(shape) + " is not a multiple of the group size " +
                                std::to_string(group));
  }
  const bool affine = mode == "affine";
  const mx::Dtype st = affine ? scales : mx::uint8;
  const size_t rows = count(shape, 0, shape.size() - 1);
  const size_t w_bytes = rows * k * bits / 8, s_bytes = rows * (k / group) * mx::size_of(st);
  const size_t total = w_bytes + s_bytes * (affine ? 2 : 1);
  if (packed.dtype() != mx::uint8 || packed.ndim() != 1 || packed.size() != total) {
    throw std::invalid_argument("packed data of " + std::to_string(packed.nbytes()) + " bytes does not hold a " +
                                std::to_string(bits) + "-bit " + mode + " weight of shape " + shape_text(shape) +
                                " (" + std::to_string(total) + " bytes)");
  }
  mx::Shape w_shape(shape.begin(), shape.end()), s_shape(shape.begin(), shape.end());
  w_shape.back() = static_cast<int>(k * bits / 32);
  s_shape.back() = static_cast<int>(k / group);
  auto part = [&](size_t from, size_t bytes, mx::Dtype t, const mx::Shape& s) {
    auto bytes_of = mx::slice(packed, {static_cast<int>(from)}, {static_cast<int>(from + bytes)});
    return mx::reshape(mx::view(bytes_of, t), s);
  };
  Parts p{part(0, w_bytes, mx::uint32, w_shape), part(w_bytes, s_bytes, st, s_shape), std::nullopt};
  if (affine) p.biases = part(w_bytes + s_bytes, s_bytes, st, s_shape);
  return p;
}

// Output columns per thread below which one more thread costs more than it
// saves (~20 us to start one against ~0.1 ns a weight).
constexpr size_t kMinWeightsPerThread = size_t(1) << 20;

void run_parallel(const q::Set& set, q::Problem p) {
  std::vector<float> prepared(set.prepared_floats(p));
  if (!prepared.empty()) {
    set.prepare(p, prepared.data());
    p.prepared = prepared.data();
  }
  size_t weights = static_cast<size_t>(p.N) * p.K * p.M;
  moat::parallel_blocks(p.N, 64, moat::threads_for(weights, kMinWeightsPerThread),
                        [&](size_t lo, size_t hi) { set.run(p, static_cast<int>(lo), static_cast<int>(hi)); });
}

q::Scale scale_storage(mx::Dtype t) {
  if (t == mx::float32) return q::F32;
  if (t == mx::float16) return q::F16;
  if (t == mx::bfloat16) return q::BF16;
  throw std::invalid_argument("affine scales and biases are float32, float16 or bfloat16");
}

// x {..., K} (f32, row-contiguous) times the packed affine weight {N, K}
// transposed: {..., N} in f32.
class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream s, int n, int k, int bits, int group, q::Scale st)
      : mx::UnaryPrimitive(s), n_(n), k_(k), bits_(bits), group_(group), st_(st) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &x = inputs[0], &packed = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    const uint8_t* w = packed.data<uint8_t>();
    size_t w_bytes = static_cast<size_t>(n_) * k_ * bits_ / 8;
    size_t s_bytes = static_cast<size_t>(n_) * (k_ / group_) * (st_ == q::F32 ? 4 : 2);
    q::Problem p{x.data<float>(), w, w + w_bytes, w + w_bytes + s_bytes, out.data<float>(),
                 static_cast<int>(x.size() / k_), n_, k_, bits_, group_, st_};
    encoder.dispatch([set = selected.load(), p] { run_parallel(*set, p); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[MoatQuantizedMatmul] has no GPU kernel");
  }

  const char* name() const override { return "MoatQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatmul&>(other);
    return o.n_ == n_ && o.k_ == k_ && o.bits_ == bits_ && o.group_ == group_ && o.st_ == st_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto s = inputs[0].shape();
    s.back() = n_;
    return {s};
  }

 private:
  int n_, k_, bits_, group_;
  q::Scale st_;
};

// Whether the shim's kernel computes x · wᵀ: on the CPU, affine, a 2-D
// weight, the bit widths it unpacks, MLX's group sizes.
bool ours(const mx::array& x, const mx::Shape& shape, int group, int bits, const std::string& mode, bool transpose) {
  return !use_mlx.load() && mx::default_device() == mx::Device::cpu && mode == "affine" && transpose &&
         shape.size() == 2 && x.ndim() >= 1 && (bits == 2 || bits == 3 || bits == 4 || bits == 6 || bits == 8) &&
         (group == 32 || group == 64 || group == 128);
}

mx::array ours_qmm(const mx::array& x, const mx::array& packed, const mx::Shape& shape, mx::Dtype scales, int group,
                   int bits) {
  auto out_shape = x.shape();
  out_shape.back() = shape[0];
  auto s = mx::default_stream(mx::Device::cpu);
  auto xf = mx::contiguous(mx::astype(x, mx::float32, s), false, s);
  auto st = scale_storage(scales);
  return mx::array(out_shape, mx::float32,
                   std::make_shared<QuantizedMatmul>(s, shape[0], shape[1], bits, group, st),
                   {xf, mx::contiguous(packed, false, s)});
}

}  // namespace

namespace moat::qmm {
void select(int set) {
  use_mlx.store(set == MOAT_KERNELS_MLX);
#if defined(__x86_64__)
  // The kernel set's AVX-512F alone does not give the BW and VL parts the
  // AVX-512 product needs: without them it takes the AVX2 one.
  __builtin_cpu_init();
  bool bw_vl = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  // With VNNI, 4 and 8 bits take the integer dot products (qmm_vnni.cpp).
  // MOAT_QMM_VNNI=0 keeps them on the f32 AVX-512 kernel (tests, benches).
  const char* off = std::getenv("MOAT_QMM_VNNI");
  bool vnni = bw_vl && __builtin_cpu_supports("avx512vnni") && !(off && std::string(off) == "0");
  selected.store(set == MOAT_KERNELS_AVX512 ? (vnni ? &avx512_vnni_set : bw_vl ? &avx512_set : &avx2_set)
                 : set == MOAT_KERNELS_AVX2 ? &avx2_set
                                            : &scalar_set);
#else
  selected.store(&scalar_set);
#endif
}
}  // namespace moat::qmm

extern "C" {

int moat_quantize(const moat_array* w, int group_size, int bits, const char* mode, int scale_dtype,
                  moat_array** out) {
  return produce(out, [&] {
    auto st = to_dtype(scale_dtype);
    scale_storage(st);
    // MLX cannot quantize an empty weight; its packed form is empty.
    if (arr(w).size() == 0) return mx::zeros({0}, mx::uint8);
    auto parts = mx::quantize(arr(w), group_size, bits, mode);
    // As MLX does for a half-width weight: the values quantized with the
    // f32 scales and biases, which are then rounded.
    if (std::string(mode) == "affine" && parts[1].dtype() != st) {
      parts[1] = mx::astype(parts[1], st);
      parts[2] = mx::astype(parts[2], st);
    }
    std::vector<mx::array> bytes;
    for (auto& p : parts) bytes.push_back(mx::flatten(mx::view(p, mx::uint8)));
    return mx::concatenate(bytes, 0);
  });
}

int moat_dequantize(const moat_array* packed, const int32_t* shape, size_t ndim, int scale_dtype, int out_dtype,
                    int group_size, int bits, const char* mode, moat_array** out) {
  return produce(out, [&] {
    auto s = to_shape(shape, ndim);
    Parts p = unpack(arr(packed), s, to_dtype(scale_dtype), group_size, bits, mode);
    auto t = to_dtype(out_dtype);
    if (p.w.size() == 0) return mx::zeros(s, t);
    // MLX computes in the scales' type: widened first, f16 scales give f32
    // values that were never rounded to f16.
    if (p.biases && p.scales.dtype() != t) {
      p.scales = mx::astype(p.scales, t);
      p.biases = mx::astype(*p.biases, t);
    }
    return mx::dequantize(p.w, p.scales, p.biases, group_size, bits, mode, std::nullopt, t);
  });
}

int moat_quantized_matmul(const moat_array* x, const moat_array* packed, const int32_t* shape, size_t ndim,
                          int scale_dtype, int group_size, int bits, const char* mode, int transpose,
                          moat_array** out) {
  return produce(out, [&] {
    auto d = to_dtype(scale_dtype);
    auto s = to_shape(shape, ndim);
    Parts p = unpack(arr(packed), s, d, group_size, bits, mode);
    const mx::array& xa = arr(x);
    if (xa.ndim() == 0 || xa.shape().back() != s[transpose ? 1 : 0]) {
      throw std::invalid_argument("[quantized_matmul] x of shape " + shape_text(xa.shape()) +
                                  " does not contract with a weight of shape " + shape_text(s));
    }
    // MLX's kernels divide by zero on empty operands.
    auto out_shape = xa.shape();
    out_shape.back() = s[transpose ? 0 : 1];
    if (xa.size() == 0 || out_shape.back() == 0) {
      bool mine = ours(xa, s, group_size, bits, mode, transpose != 0);
      return mx::zeros(out_shape, mine ? mx::float32 : xa.dtype());
    }
    if (ours(xa, s, group_size, bits, mode, transpose != 0)) return ours_qmm(xa, arr(packed), s, d, group_size, bits);
    return mx::quantized_matmul(xa, p.w, p.scales, p.biases, transpose != 0, group_size, bits, mode);
  });
}

int moat_gather_qmm(const moat_array* x, const moat_array* packed, const int32_t* shape, size_t ndim,
                    int scale_dtype, int group_size, int bits, const char* mode, const moat_array* lhs_indices,
                    const moat_array* rhs_indices, int transpose, int sorted, moat_array** out) {
  return produce(out, [&] {
    auto d = to_dtype(scale_dtype);
    Parts p = unpack(arr(packed), to_shape(shape, ndim), d, group_size, bits, mode);
    auto maybe = [](const moat_array* a) { return a ? std::optional<mx::array>(arr(a)) : std::nullopt; };
    auto y = mx::gather_qmm(arr(x), p.w, p.scales, p.biases, maybe(lhs_indices), maybe(rhs_indices),
                            transpose != 0, group_size, bits, mode, std::nullopt, sorted != 0);
    // As for quantized_matmul: nothing to compute, nothing for MLX to divide by.
    return y.size() == 0 ? mx::zeros(y.shape(), y.dtype()) : y;
  });
}

}  // extern "C"
