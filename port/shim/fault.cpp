// The fault-injection build's device fault (see src/fault.rs): a kernel that
// writes through a wild pointer. Only that build has it.
#ifdef MOAT_FAULT_INJECTION
#include "shim_core.hpp"

using namespace moat;

extern "C" int moat_fault_device_write(void) {
  return guard([&] {
    if (!mx::is_available(mx::Device::gpu)) throw std::runtime_error("no GPU to fault");
    auto kernel = mx::fast::cuda_kernel(
        "moat_wild_write", {"inp"}, {"out"},
        "  out[0] = inp[0];\n"
        "  if (threadIdx.x == 0 && blockIdx.x == 0) *reinterpret_cast<volatile float*>(0x10) = inp[0];\n");
    auto in = mx::array({1.0f});
    auto outs = kernel({in}, {{1}}, {mx::float32}, {1, 1, 1}, {1, 1, 1}, {}, std::nullopt, false, mx::Device::gpu);
    mx::eval(outs);
    // Reading back waits for the stream, where the fault surfaces.
    (void)outs[0].item<float>();
  });
}
#endif
