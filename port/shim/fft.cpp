// Fourier transforms.
#include "shim_core.hpp"

using namespace moat;

#define MOAT_FFT(name)                                                                   \
  int moat_##name(const moat_array* a, const int32_t* n, const int32_t* axes, size_t k,  \
                  moat_array** out) {                                                    \
    return produce(out, [&] { return mx::fft::name(arr(a), to_shape(n, k), to_axes(axes, k)); }); \
  }

extern "C" {

MOAT_FFT(fftn)
MOAT_FFT(ifftn)
MOAT_FFT(rfftn)
MOAT_FFT(irfftn)

}  // extern "C"
