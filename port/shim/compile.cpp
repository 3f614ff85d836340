// mlx::core::compile over a function that calls back into the worker: a
// program's steps, traced once per input signature, then replayed fused.
#include <cstdint>
#include <functional>
#include <stdexcept>

#include "mlx/compile_impl.h"
#include "shim_core.hpp"

struct moat_compiled {
  std::function<std::vector<mlx::core::array>(const std::vector<mlx::core::array>&)> fn;
  uintptr_t id;
  size_t outputs;
};

using namespace moat;

extern "C" {

int moat_compile(moat_trace_fn trace, void* ctx, uintptr_t id, size_t outputs, moat_compiled** out) {
  return guard([&] {
    auto body = [trace, ctx, outputs](const std::vector<mx::array>& inputs) {
      // The callee owns the input handles and hands over the output ones.
      std::vector<moat_array*> ins;
      ins.reserve(inputs.size());
      for (const auto& a : inputs) ins.push_back(wrap(mx::array(a)));
      std::vector<moat_array*> outs(outputs, nullptr);
      if (trace(ctx, ins.data(), ins.size(), outs.data(), outs.size()) != MOAT_OK) {
        for (auto* o : outs) delete reinterpret_cast<mx::array*>(o);
        throw std::runtime_error("the program's trace failed");
      }
      std::vector<mx::array> result;
      result.reserve(outputs);
      for (auto* o : outs) {
        result.push_back(arr(o));
        delete reinterpret_cast<mx::array*>(o);
      }
      return result;
    };
    *out = new moat_compiled{mx::detail::compile(body, id), id, outputs};
  });
}

int moat_compiled_call(const moat_compiled* f, moat_array* const* ins, size_t n_ins, moat_array** outs,
                       size_t n_outs) {
  return guard([&] {
    auto result = f->fn(to_arrays(ins, n_ins));
    if (result.size() != n_outs) throw std::runtime_error("a compiled program gave the wrong number of outputs");
    for (size_t i = 0; i < n_outs; ++i) outs[i] = wrap(std::move(result[i]));
  });
}

void moat_compiled_free(moat_compiled* f) {
  // Dropping MLX's cache entry cannot be reported to anyone; it is attempted.
  guard([&] { mx::detail::compile_erase(mx::detail::compile_cache(), f->id); });
  delete f;
}

}  // extern "C"
