// Matrix products and decompositions. MLX implements the decompositions on
// the CPU only, so they name the CPU stream explicitly.
#include "shim_core.hpp"

using namespace moat;

namespace {
const mx::StreamOrDevice kCpu = mx::Device::cpu;

template <typename F>
int produce_all(moat_array** outs, F&& f) {
  return guard([&] {
    std::vector<mx::array> v = f();
    for (size_t i = 0; i < v.size(); ++i) outs[i] = wrap(std::move(v[i]));
  });
}
}  // namespace

extern "C" {

int moat_matmul(const moat_array* a, const moat_array* b, moat_array** out) {
  return produce(out, [&] { return mx::matmul(arr(a), arr(b)); });
}

int moat_qr(const moat_array* a, moat_array** outs) {
  return produce_all(outs, [&] {
    auto [q, r] = mx::linalg::qr(arr(a), kCpu);
    return std::vector<mx::array>{q, r};
  });
}

int moat_svd(const moat_array* a, moat_array** outs) {
  return produce_all(outs, [&] { return mx::linalg::svd(arr(a), true, kCpu); });
}

int moat_eigh(const moat_array* a, moat_array** outs) {
  return produce_all(outs, [&] {
    auto [w, v] = mx::linalg::eigh(arr(a), "L", kCpu);
    return std::vector<mx::array>{w, v};
  });
}

int moat_lu(const moat_array* a, moat_array** outs) {
  return produce_all(outs, [&] { return mx::linalg::lu(arr(a), kCpu); });
}

int moat_cholesky(const moat_array* a, int upper, moat_array** out) {
  return produce(out, [&] { return mx::linalg::cholesky(arr(a), upper != 0, kCpu); });
}

int moat_solve(const moat_array* a, const moat_array* b, moat_array** out) {
  return produce(out, [&] { return mx::linalg::solve(arr(a), arr(b), kCpu); });
}

int moat_solve_triangular(const moat_array* a, const moat_array* b, int upper,
                          moat_array** out) {
  return produce(out, [&] { return mx::linalg::solve_triangular(arr(a), arr(b), upper != 0, kCpu); });
}

}  // extern "C"
