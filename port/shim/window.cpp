// Convolution (windows are built from as_strided views and reductions).
#include "shim_core.hpp"

using namespace moat;

extern "C" {

int moat_conv_general(const moat_array* input, const moat_array* weight, const int32_t* strides,
                      const int32_t* pad_lo, const int32_t* pad_hi,
                      const int32_t* kernel_dilation, const int32_t* input_dilation, size_t n,
                      int groups, moat_array** out) {
  return produce(out, [&] {
    return mx::conv_general(arr(input), arr(weight), to_axes(strides, n), to_axes(pad_lo, n),
                            to_axes(pad_hi, n), to_axes(kernel_dilation, n),
                            to_axes(input_dilation, n), groups, false);
  });
}

}  // extern "C"
