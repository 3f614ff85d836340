// mlx::core::fast kernels (fused on the GPU; compositions on the CPU), and
// on the CPU one-pass kernels of the shim's own for RMS norm and attention
// (kernels.h's Rows: the kernel set picked at start), as MLX primitives.
// Nullable pointers are std::nullopt.
#include <algorithm>
#include <optional>
#include <stdexcept>
#include <thread>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/primitives.h"
#include "shim_core.hpp"

using namespace moat;
namespace k = moat::kernels;

namespace {
std::optional<mx::array> maybe(const moat_array* a) {
  return a ? std::optional<mx::array>(arr(a)) : std::nullopt;
}

std::optional<k::Storage> storage(mx::Dtype t) {
  if (t == mx::float32) return k::F32;
  if (t == mx::float16) return k::F16;
  if (t == mx::bfloat16) return k::BF16;
  return std::nullopt;
}

// Runs f(lo, hi) over [0, n) in blocks, on up to the machine's cores when
// the work (`cost` per item) pays for a thread (~20 us to start one).
template <typename F>
void parallel(size_t n, size_t cost, F&& f) {
  size_t cores = std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
  size_t threads = std::max<size_t>(1, std::min({cores, n, n * cost / (1 << 19)}));
  if (threads == 1) return f(0, n);
  std::vector<std::thread> helpers;
  size_t per = (n + threads - 1) / threads;
  try {
    for (size_t t = 1; t < threads; ++t) {
      size_t lo = t * per, hi = std::min(n, lo + per);
      if (lo < hi) helpers.emplace_back([&f, lo, hi] { f(lo, hi); });
    }
  } catch (const std::exception&) {
    // No thread to be had: this one does the rest.
    for (size_t t = helpers.size() + 1; t < threads; ++t) f(t * per, std::min(n, t * per + per));
  }
  f(0, std::min(n, per));
  for (auto& t : helpers) t.join();
}

void allocate(mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
}

// x laid out row-contiguously (a view that is already shares its buffer).
mx::array dense(const mx::array& x, mx::Stream s) { return mx::contiguous(x, false, s); }

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream s, const k::Rows* rows, float eps) : mx::UnaryPrimitive(s), rows_(rows), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    allocate(out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    size_t n = x.shape().back();
    encoder.dispatch([rows = rows_, eps = eps_, st = *storage(x.dtype()), px = x.data<char>(),
                      pw = inputs.size() > 1 ? inputs[1].data<char>() : nullptr, po = out.data<char>(),
                      n, count = n ? x.size() / n : 0, es = x.itemsize()] {
      parallel(count, n, [&](size_t lo, size_t hi) {
        for (size_t r = lo; r < hi; ++r) rows->rms_norm(st, px + r * n * es, pw, po + r * n * es, n, eps);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[MoatRmsNorm] has no GPU kernel");
  }

  const char* name() const override { return "MoatRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RmsNorm&>(other);
    return o.rows_ == rows_ && o.eps_ == eps_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  const k::Rows* rows_;
  float eps_;
};

// Attention of q {B, Hq, Tq, D} over k {B, Hkv, Tk, D}, v {B, Hkv, Tk, Dv}
// (all row-contiguous), then the optional int32 lengths {B} and starts {B}
// and float32 sinks {Hq}, in that order.
class Attention : public mx::UnaryPrimitive {
 public:
  struct Spec {
    float scale;
    bool causal, lengths, starts, sinks;
    bool operator==(const Spec&) const = default;
  };

  Attention(mx::Stream s, const k::Rows* rows, Spec spec) : mx::UnaryPrimitive(s), rows_(rows), spec_(spec) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    allocate(out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    const auto &q = inputs[0], &kk = inputs[1], &v = inputs[2];
    size_t next = 3;
    const int32_t* lengths = spec_.lengths ? inputs[next++].data<int32_t>() : nullptr;
    const int32_t* starts = spec_.starts ? inputs[next++].data<int32_t>() : nullptr;
    const float* sinks = spec_.sinks ? inputs[next++].data<float>() : nullptr;
    size_t b = q.shape(0), hq = q.shape(1), tq = q.shape(2), d = q.shape(3);
    size_t hkv = kk.shape(1), tk = kk.shape(2), dv = v.shape(3);
    encoder.dispatch([rows = rows_, spec = spec_, st = *storage(q.dtype()), es = q.itemsize(),
                      pq = q.data<char>(), pk = kk.data<char>(), pv = v.data<char>(), po = out.data<char>(),
                      lengths, starts, sinks, b, hq, tq, d, hkv, tk, dv] {
      // The query rows of one kv head are consecutive (heads h*reps ..
      // (h+1)*reps - 1, each of tq rows): they go through the kernel
      // together, in chunks of at most 64 rows, split further when there
      // are fewer heads than cores.
      size_t group = hq / hkv * tq, heads = b * hkv;
      if (group == 0 || heads == 0) return;
      size_t cores = std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
      size_t pieces = heads >= cores ? 1 : (cores + heads - 1) / heads;
      size_t chunk = std::max<size_t>(1, std::min<size_t>(64, (group + pieces - 1) / pieces));
      size_t per = (group + chunk - 1) / chunk;
      parallel(heads * per, chunk * tk * (d + dv), [&](size_t lo, size_t hi) {
        std::vector<float> scratch(k::attend_scratch(chunk, dv));
        std::vector<size_t> from(chunk), to(chunk);
        std::vector<float> sink(chunk);
        for (size_t item = lo; item < hi; ++item) {
          size_t g = item / per, r0 = item % per * chunk, count = std::min(chunk, group - r0);
          size_t n = g / hkv;
          long end = lengths ? std::clamp<long>(lengths[n], 0, tk) : static_cast<long>(tk);
          long begin = starts ? std::clamp<long>(starts[n], 0, tk) : 0;
          for (size_t r = 0; r < count; ++r) {
            size_t i = (r0 + r) % tq, h = g % hkv * (hq / hkv) + (r0 + r) / tq;
            // The queries are the last tq positions of [0, end).
            long stop = spec.causal ? std::clamp<long>(end - static_cast<long>(tq) + static_cast<long>(i) + 1, 0, end) : end;
            from[r] = begin;
            to[r] = std::max(begin, stop);
            if (sinks) sink[r] = sinks[h];
          }
          size_t row = g * group + r0;
          rows->attend(st, pq + row * d * es, count, pk + g * tk * d * es, pv + g * tk * dv * es, d, dv, from.data(),
                       to.data(), spec.scale, sinks ? sink.data() : nullptr, scratch.data(), po + row * dv * es);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[MoatAttention] has no GPU kernel");
  }

  const char* name() const override { return "MoatAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attention&>(other);
    return o.rows_ == rows_ && o.spec_ == spec_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape().back();
    return {shape};
  }

 private:
  const k::Rows* rows_;
  Spec spec_;
};

// The boolean {B, 1, Tq, Tk} mask of lengths, starts and causality, for
// MLX's kernel; null when there is none of them.
std::optional<mx::array> key_mask(const mx::array& q, const mx::array& kk, bool causal,
                                  const std::optional<mx::array>& lengths,
                                  const std::optional<mx::array>& starts) {
  if (!lengths && !starts) return std::nullopt;
  int b = q.shape(0), tq = q.shape(2), tk = kk.shape(2);
  auto keys = mx::reshape(mx::arange(tk, mx::int32), {1, 1, 1, tk});
  auto per = [b](const mx::array& a) { return mx::reshape(mx::astype(a, mx::int32), {b, 1, 1, 1}); };
  auto end = lengths ? per(*lengths) : mx::full({b, 1, 1, 1}, tk, mx::int32);
  auto keep = mx::less(keys, end);
  if (starts) keep = mx::logical_and(keep, mx::greater_equal(keys, per(*starts)));
  if (causal) {
    auto rows = mx::reshape(mx::arange(tq, mx::int32), {1, 1, tq, 1});
    keep = mx::logical_and(keep, mx::less_equal(keys, mx::add(mx::subtract(end, mx::array(tq)), rows)));
  }
  return keep;
}
}  // namespace

extern "C" {

int moat_fast_rms_norm(const moat_array* x, const moat_array* weight, float eps,
                       moat_array** out) {
  return produce(out, [&] {
    const mx::array& a = arr(x);
    const k::Rows* rows = k::cpu_rows();
    if (!rows || !storage(a.dtype()) || a.ndim() == 0 || (weight && arr(weight).dtype() != a.dtype())) {
      return mx::fast::rms_norm(a, maybe(weight), eps);
    }
    auto s = mx::default_stream(mx::Device::cpu);
    std::vector<mx::array> in = {dense(a, s)};
    if (weight) in.push_back(dense(arr(weight), s));
    return mx::array(a.shape(), a.dtype(), std::make_shared<RmsNorm>(s, rows, eps), std::move(in));
  });
}

int moat_fast_layer_norm(const moat_array* x, const moat_array* weight, const moat_array* bias,
                         float eps, moat_array** out) {
  return produce(out,
                 [&] { return mx::fast::layer_norm(arr(x), maybe(weight), maybe(bias), eps); });
}

int moat_fast_rope(const moat_array* x, int dims, int traditional, float base, float scale,
                   int offset, const moat_array* freqs, moat_array** out) {
  return produce(out, [&] {
    std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
    return mx::fast::rope(arr(x), dims, traditional != 0, b, scale, offset, maybe(freqs));
  });
}

int moat_fast_rope_offsets(const moat_array* x, int dims, int traditional, float base,
                           float scale, const moat_array* offset, const moat_array* freqs,
                           moat_array** out) {
  return produce(out, [&] {
    std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
    return mx::fast::rope(arr(x), dims, traditional != 0, b, scale, arr(offset), maybe(freqs));
  });
}

int moat_fast_attention(const moat_array* q, const moat_array* k, const moat_array* v, float scale,
                        int causal, const moat_array* mask, const moat_array* lengths,
                        const moat_array* starts, const moat_array* sinks, moat_array** out) {
  return produce(out, [&] {
    const mx::array &qa = arr(q), &ka = arr(k), &va = arr(v);
    const k::Rows* rows = k::cpu_rows();
    auto st = storage(qa.dtype());
    if (rows && st && !mask && ka.dtype() == qa.dtype() && va.dtype() == qa.dtype()) {
      auto s = mx::default_stream(mx::Device::cpu);
      std::vector<mx::array> in = {dense(qa, s), dense(ka, s), dense(va, s)};
      if (lengths) in.push_back(dense(mx::astype(arr(lengths), mx::int32, s), s));
      if (starts) in.push_back(dense(mx::astype(arr(starts), mx::int32, s), s));
      if (sinks) in.push_back(dense(mx::astype(arr(sinks), mx::float32, s), s));
      Attention::Spec spec{scale, causal != 0, lengths != nullptr, starts != nullptr, sinks != nullptr};
      auto shape = qa.shape();
      shape.back() = va.shape().back();
      return mx::array(shape, qa.dtype(), std::make_shared<Attention>(s, rows, spec), std::move(in));
    }
    auto keep = key_mask(qa, ka, causal != 0, maybe(lengths), maybe(starts));
    std::optional<mx::array> m = maybe(mask);
    if (keep && m) {
      m = m->dtype() == mx::bool_ ? mx::logical_and(*keep, *m)
                                  : mx::where(*keep, *m, mx::array(-INFINITY, m->dtype()));
    } else if (keep) {
      m = keep;
    }
    std::string mode = causal && !keep ? "causal" : "";
    std::optional<mx::array> sink = sinks ? std::optional<mx::array>(mx::astype(arr(sinks), qa.dtype())) : std::nullopt;
    return mx::fast::scaled_dot_product_attention(qa, ka, va, scale, mode, m, sink);
  });
}

}  // extern "C"
