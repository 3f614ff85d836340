// C ABI over MLX's C++ API. One thin function per MLX call, no policy.
// Every function returns MOAT_OK, or MOAT_ERR_EXCEPTION / MOAT_ERR_UNKNOWN
// after catching what MLX threw; moat_last_error() then holds the message
// (per thread, valid until the next failing call on that thread).
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOAT_OK 0
#define MOAT_ERR_EXCEPTION 1
#define MOAT_ERR_UNKNOWN 2
#define MOAT_ERR_ALLOC 3

// Dtype codes: the order of mlx::core::Dtype::Val.
enum moat_dtype {
  MOAT_BOOL, MOAT_U8, MOAT_U16, MOAT_U32, MOAT_U64,
  MOAT_S8, MOAT_S16, MOAT_S32, MOAT_S64,
  MOAT_F16, MOAT_F32, MOAT_F64, MOAT_BF16, MOAT_C64,
};

enum moat_device { MOAT_CPU = 0, MOAT_GPU = 1 };

typedef struct moat_array moat_array;   // an mlx::core::array
typedef struct moat_buffer moat_buffer; // an mlx::core::allocator::Data

const char* moat_last_error(void);
const char* moat_mlx_version(void);

// Devices
// The fault-injection build only (fault.cpp): a GPU kernel that writes
// through a wild pointer.
int moat_fault_device_write(void);
int moat_device_available(int device, int* out);
int moat_set_default_device(int device);
int moat_device_count(int device, int* out);
// What MLX reports of device `index` of this kind: its name (NUL-terminated,
// cut to name_cap bytes), total memory in bytes, and compute capability
// (0.0 where the backend has none, as on the CPU).
int moat_device_info(int device, int index, char* name, size_t name_cap, uint64_t* memory,
                     int* cc_major, int* cc_minor);

// Buffers from MLX's allocator, filled by the caller, then adopted by an array.
int moat_buffer_alloc(size_t nbytes, moat_buffer** out, void** data);
void moat_buffer_free(moat_buffer* buf);
int moat_array_from_buffer(moat_buffer* buf, const int32_t* shape, size_t ndim,
                           int dtype, moat_array** out);
// An array over memory the caller owns (nbytes at data, with `room` writable
// bytes before it), without a copy where the allocator allows. release(ctx)
// runs exactly once, when MLX no longer needs the memory, or before this
// returns if it fails.
int moat_array_from_external(void* data, size_t nbytes, size_t room, const int32_t* shape, size_t ndim,
                             int dtype, void (*release)(void*), void* ctx, moat_array** out);

// Array handles and metadata
void moat_array_free(moat_array* a);
int moat_array_clone(const moat_array* a, moat_array** out);
size_t moat_array_ndim(const moat_array* a);
void moat_array_shape(const moat_array* a, int32_t* out);
int moat_array_dtype(const moat_array* a);
size_t moat_array_size(const moat_array* a);
size_t moat_array_nbytes(const moat_array* a);
int moat_array_row_contiguous(const moat_array* a);
// Valid only for an evaluated array; the bytes of a row-contiguous array.
const void* moat_array_data(const moat_array* a);

// Evaluation
int moat_eval(moat_array* const* arrays, size_t n);

// mlx::core::compile of a function whose body is the callback `trace`: it
// receives owned handles of the inputs (tracers) and writes owned handles of
// its `outputs` into `outs`, returning MOAT_OK, or anything else to fail.
// `id` keys MLX's cache of traces; unique among live compiled functions.
typedef struct moat_compiled moat_compiled;
typedef int (*moat_trace_fn)(void* ctx, moat_array* const* ins, size_t n_ins, moat_array** outs, size_t n_outs);
int moat_compile(moat_trace_fn trace, void* ctx, uintptr_t id, size_t outputs, moat_compiled** out);
int moat_compiled_call(const moat_compiled* f, moat_array* const* ins, size_t n_ins, moat_array** outs,
                       size_t n_outs);
void moat_compiled_free(moat_compiled* f);
int moat_async_eval(moat_array* const* arrays, size_t n);
// async_eval with the CPU stream's thread held until every task of it is
// queued: the kernels then run back to back, where an idle thread would be
// woken for each op (a context switch per op on a busy machine).
int moat_async_eval_gated(moat_array* const* arrays, size_t n);
// 1 when a synchronous evaluation runs MLX's CPU tasks on the calling thread
// (scheduler.cpp; MOAT_INLINE_EVAL=0 turns it off), else 0.
int moat_inline_eval(void);
// What this thread ran inline, and handed to a CPU stream's thread, so far,
// and MLX's count of active tasks (its scheduler's `n_active_tasks`).
void moat_inline_eval_stats(uint64_t* inlined, uint64_t* forwarded, int64_t* active);

// Memory (memory.cpp): MLX's allocator statistics and limits.
size_t moat_active_memory(void);
size_t moat_peak_memory(void);
size_t moat_cache_memory(void);
size_t moat_memory_limit(void);
int moat_reset_peak_memory(void);
int moat_set_memory_limit(size_t limit, size_t* previous);
int moat_set_cache_limit(size_t limit, size_t* previous);
int moat_clear_cache(void);
// Memory files open for large CPU buffers (alloc.cpp), live and cached.
size_t moat_buffer_files_open(void);
// The memory file holding an evaluated, row-contiguous array's bytes, made
// read-only and sealed for good (alloc.cpp); out->fd is -1 when its bytes
// are in no such file.
typedef struct {
  int fd;
  size_t file_bytes;
  size_t offset;
} moat_export;
// `seal` 0 leaves it unsealed (the fault-injection build's `:unsealed`).
int moat_array_export(const moat_array* a, int seal, moat_export* out);
// Holds an evaluated array's buffer as an exported one (MLX never donates it)
// until nothing else holds it: for buffers exported outside alloc.cpp.
int moat_array_hold(const moat_array* a);
// Lets go of exported buffers nothing else holds; returns how many are held.
size_t moat_exports_sweep(void);
// The lazy graph behind an array: its status, identity, op, inputs and
// siblings (handles written to *out are new and owned by the caller).
int moat_array_unscheduled(const moat_array* a);
int moat_array_available(const moat_array* a);
uintptr_t moat_array_id(const moat_array* a);
// The name of the op that computes the array (static), or NULL for none.
const char* moat_array_primitive(const moat_array* a);
size_t moat_array_num_inputs(const moat_array* a);
int moat_array_input(const moat_array* a, size_t i, moat_array** out);
size_t moat_array_num_siblings(const moat_array* a);
int moat_array_sibling(const moat_array* a, size_t i, moat_array** out);

// Ops, one section per family (shim/<family>.cpp). Each writes a new array
// to *out.

// -- shape and type (shape.cpp)
int moat_astype(const moat_array* a, int dtype, moat_array** out);
int moat_contiguous(const moat_array* a, moat_array** out);
int moat_reshape(const moat_array* a, const int32_t* shape, size_t ndim, moat_array** out);
int moat_broadcast_to(const moat_array* a, const int32_t* shape, size_t ndim, moat_array** out);
int moat_view(const moat_array* a, int dtype, moat_array** out);
int moat_transpose(const moat_array* a, const int32_t* axes, size_t naxes, moat_array** out);
int moat_flip(const moat_array* a, const int32_t* axes, size_t naxes, moat_array** out);
int moat_slice(const moat_array* a, const int32_t* start, const int32_t* stop,
               const int32_t* strides, size_t ndim, moat_array** out);
int moat_slice_update(const moat_array* src, const moat_array* update, const int32_t* start,
                      const int32_t* stop, const int32_t* strides, size_t ndim,
                      moat_array** out);
int moat_concatenate(const moat_array* const* arrays, size_t n, int axis, moat_array** out);
int moat_stack(const moat_array* const* arrays, size_t n, int axis, moat_array** out);
int moat_where(const moat_array* cond, const moat_array* a, const moat_array* b,
               moat_array** out);

// -- creation (creation.cpp)
int moat_full(const int32_t* shape, size_t ndim, const moat_array* value, int dtype,
              moat_array** out);
int moat_arange(double start, double stop, double step, int dtype, moat_array** out);
int moat_eye(int n, int m, int k, int dtype, moat_array** out);
int moat_pad(const moat_array* a, const int32_t* low, const int32_t* high, size_t ndim,
             const moat_array* value, moat_array** out);
int moat_as_strided(const moat_array* a, const int32_t* shape, const int64_t* strides,
                    size_t ndim, size_t offset, moat_array** out);
int moat_tril(const moat_array* a, int k, moat_array** out);
int moat_diagonal(const moat_array* a, int offset, int axis1, int axis2, moat_array** out);

// -- element-wise (elementwise.cpp)
int moat_add(const moat_array* a, const moat_array* b, moat_array** out);
int moat_subtract(const moat_array* a, const moat_array* b, moat_array** out);
int moat_multiply(const moat_array* a, const moat_array* b, moat_array** out);
int moat_divide(const moat_array* a, const moat_array* b, moat_array** out);
int moat_power(const moat_array* a, const moat_array* b, moat_array** out);
int moat_arctan2(const moat_array* a, const moat_array* b, moat_array** out);
int moat_minimum(const moat_array* a, const moat_array* b, moat_array** out);
int moat_maximum(const moat_array* a, const moat_array* b, moat_array** out);
int moat_bitwise_and(const moat_array* a, const moat_array* b, moat_array** out);
int moat_bitwise_or(const moat_array* a, const moat_array* b, moat_array** out);
int moat_bitwise_xor(const moat_array* a, const moat_array* b, moat_array** out);
int moat_left_shift(const moat_array* a, const moat_array* b, moat_array** out);
int moat_right_shift(const moat_array* a, const moat_array* b, moat_array** out);
int moat_equal(const moat_array* a, const moat_array* b, moat_array** out);
int moat_not_equal(const moat_array* a, const moat_array* b, moat_array** out);
int moat_greater(const moat_array* a, const moat_array* b, moat_array** out);
int moat_less(const moat_array* a, const moat_array* b, moat_array** out);
int moat_greater_equal(const moat_array* a, const moat_array* b, moat_array** out);
int moat_less_equal(const moat_array* a, const moat_array* b, moat_array** out);
int moat_logical_and(const moat_array* a, const moat_array* b, moat_array** out);
int moat_logical_or(const moat_array* a, const moat_array* b, moat_array** out);
int moat_exp(const moat_array* a, moat_array** out);
int moat_expm1(const moat_array* a, moat_array** out);
int moat_log(const moat_array* a, moat_array** out);
int moat_log1p(const moat_array* a, moat_array** out);
int moat_sigmoid(const moat_array* a, moat_array** out);
int moat_cos(const moat_array* a, moat_array** out);
int moat_sin(const moat_array* a, moat_array** out);
int moat_tan(const moat_array* a, moat_array** out);
int moat_cosh(const moat_array* a, moat_array** out);
int moat_sinh(const moat_array* a, moat_array** out);
int moat_tanh(const moat_array* a, moat_array** out);
int moat_arccos(const moat_array* a, moat_array** out);
int moat_arcsin(const moat_array* a, moat_array** out);
int moat_arctan(const moat_array* a, moat_array** out);
int moat_arccosh(const moat_array* a, moat_array** out);
int moat_arcsinh(const moat_array* a, moat_array** out);
int moat_arctanh(const moat_array* a, moat_array** out);
int moat_sqrt(const moat_array* a, moat_array** out);
int moat_rsqrt(const moat_array* a, moat_array** out);
int moat_erf(const moat_array* a, moat_array** out);
int moat_erfinv(const moat_array* a, moat_array** out);
int moat_abs(const moat_array* a, moat_array** out);
int moat_bitwise_invert(const moat_array* a, moat_array** out);
int moat_ceil(const moat_array* a, moat_array** out);
int moat_floor(const moat_array* a, moat_array** out);
int moat_trunc(const moat_array* a, moat_array** out);
int moat_conjugate(const moat_array* a, moat_array** out);
int moat_negative(const moat_array* a, moat_array** out);
int moat_sign(const moat_array* a, moat_array** out);
int moat_real(const moat_array* a, moat_array** out);
int moat_imag(const moat_array* a, moat_array** out);
int moat_isnan(const moat_array* a, moat_array** out);
int moat_isinf(const moat_array* a, moat_array** out);
int moat_logical_not(const moat_array* a, moat_array** out);
int moat_floor_divide(const moat_array* a, const moat_array* b, moat_array** out);
int moat_remainder(const moat_array* a, const moat_array* b, moat_array** out);
int moat_isfinite(const moat_array* a, moat_array** out);

// -- reductions, cumulative ops and sorting (reduction.cpp)
int moat_sum(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
             moat_array** out);
int moat_prod(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
              moat_array** out);
int moat_max(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
              moat_array** out);
int moat_min(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
              moat_array** out);
int moat_all(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
              moat_array** out);
int moat_any(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
              moat_array** out);
int moat_argmax(const moat_array* a, int axis, int keepdims, moat_array** out);
int moat_argmin(const moat_array* a, int axis, int keepdims, moat_array** out);
// Inclusive scans along one axis.
int moat_cumsum(const moat_array* a, int axis, int reverse, moat_array** out);
int moat_cumprod(const moat_array* a, int axis, int reverse, moat_array** out);
int moat_cummax(const moat_array* a, int axis, int reverse, moat_array** out);
int moat_cummin(const moat_array* a, int axis, int reverse, moat_array** out);
// Stable, NaN last.
int moat_sort(const moat_array* a, int axis, moat_array** out);
int moat_argsort(const moat_array* a, int axis, moat_array** out);

// -- indexing (indexing.cpp)
// MLX does not bounds-check indices: callers check them first.
int moat_take(const moat_array* a, const moat_array* indices, int axis, moat_array** out);
int moat_take_along_axis(const moat_array* a, const moat_array* indices, int axis,
                         moat_array** out);
int moat_scatter(const moat_array* a, const moat_array* indices, const moat_array* updates,
                 int axis, moat_array** out);
int moat_scatter_add(const moat_array* a, const moat_array* indices,
                     const moat_array* updates, int axis, moat_array** out);
int moat_slice_dynamic(const moat_array* a, const moat_array* start, const int32_t* axes,
                       const int32_t* sizes, size_t n, moat_array** out);
int moat_slice_update_dynamic(const moat_array* src, const moat_array* update,
                              const moat_array* start, const int32_t* axes, size_t n,
                              moat_array** out);

// -- linear algebra (linalg.cpp)
int moat_matmul(const moat_array* a, const moat_array* b, moat_array** out);
// x {M, K} . w^T for w {N, K}, or x . w for w {K, N} when transposed; both of
// one float type, accumulated in f32. On the CPU with M <= 16: one pass over
// w in its own storage (matvec.cpp); otherwise MLX's matmul.
int moat_matvec(const moat_array* x, const moat_array* w, int transposed, moat_array** out);
// Decompositions run on the CPU stream (MLX has no GPU kernels for them).
// outs[] receives the listed factors in order.
int moat_qr(const moat_array* a, moat_array** outs /* q, r */);
int moat_svd(const moat_array* a, moat_array** outs /* u, s, vt */);
int moat_eigh(const moat_array* a, moat_array** outs /* eigenvalues, eigenvectors */);
int moat_lu(const moat_array* a, moat_array** outs /* row pivots, l, u */);
int moat_cholesky(const moat_array* a, int upper, moat_array** out);
int moat_solve(const moat_array* a, const moat_array* b, moat_array** out);
int moat_solve_triangular(const moat_array* a, const moat_array* b, int upper,
                          moat_array** out);

// -- windows and convolution (window.cpp)
// input [N, spatial..., C], weight [O, spatial..., C / groups]; n spatial dims.
int moat_conv_general(const moat_array* input, const moat_array* weight, const int32_t* strides,
                      const int32_t* pad_lo, const int32_t* pad_hi,
                      const int32_t* kernel_dilation, const int32_t* input_dilation, size_t n,
                      int groups, moat_array** out);

// -- fft (fft.cpp)
// Over `axes` with lengths `n` (each pads or truncates), unnormalised forward.
int moat_fftn(const moat_array* a, const int32_t* n, const int32_t* axes, size_t k,
              moat_array** out);
int moat_ifftn(const moat_array* a, const int32_t* n, const int32_t* axes, size_t k,
               moat_array** out);
int moat_rfftn(const moat_array* a, const int32_t* n, const int32_t* axes, size_t k,
               moat_array** out);
int moat_irfftn(const moat_array* a, const int32_t* n, const int32_t* axes, size_t k,
                moat_array** out);

// -- fast kernels (fast.cpp)
// mlx::core::fast: fused on the GPU; MLX's own compositions on the CPU.
// A null weight, bias, freqs or mask is std::nullopt; with freqs, base is unused.
int moat_fast_rms_norm(const moat_array* x, const moat_array* weight, float eps,
                       moat_array** out);
int moat_fast_layer_norm(const moat_array* x, const moat_array* weight, const moat_array* bias,
                         float eps, moat_array** out);
int moat_fast_rope(const moat_array* x, int dims, int traditional, float base, float scale,
                   int offset, const moat_array* freqs, moat_array** out);
// offset: a scalar or one start position per batch (axis 0), int32.
int moat_fast_rope_offsets(const moat_array* x, int dims, int traditional, float base,
                           float scale, const moat_array* offset, const moat_array* freqs,
                           moat_array** out);
// Attention; causal aligns the queries with the last keys (of the valid
// prefix when lengths is given); mask (boolean or additive), lengths and
// starts (integer {B}: keys j < starts[b] or j >= lengths[b] are masked) and
// sinks ({Hq} logits) may be null. On the CPU without a mask: the shim's
// one-pass kernel.
int moat_fast_attention(const moat_array* q, const moat_array* k, const moat_array* v, float scale,
                        int causal, const moat_array* mask, const moat_array* lengths,
                        const moat_array* starts, const moat_array* sinks, moat_array** out);

// The shim's own vectorized CPU kernels (kernels.cpp) of f32, f16 and bf16
// element-wise functions, computed in f32. moat_kernels_select picks the
// kernel set once at start: MOAT_KERNELS_AUTO takes AVX-512 when cpuid
// reports AVX-512F (with AVX2, FMA and F16C), else AVX2 when it reports
// those three, else scalar; asking for a set the CPU lacks fails.
// MOAT_KERNELS_MLX leaves the ops to MLX's own CPU kernels (for comparison).
enum moat_kernels {
  MOAT_KERNELS_AUTO = -1, MOAT_KERNELS_SCALAR = 0, MOAT_KERNELS_AVX2 = 1, MOAT_KERNELS_AVX512 = 2,
  MOAT_KERNELS_MLX = 3
};
enum moat_kernel_op {
  MOAT_K_EXP, MOAT_K_EXPM1, MOAT_K_LOG, MOAT_K_LOG1P, MOAT_K_TANH, MOAT_K_SIGMOID,
  MOAT_K_ERF, MOAT_K_ERFC, MOAT_K_SIN, MOAT_K_COS, MOAT_K_RSQRT,
};
int moat_kernels_select(int want, int* selected);
// op(a); on a GPU default device computed in double on the GPU and rounded
// to f32 (then to f16 or bf16); on the CPU, MLX's own op when the set is
// MOAT_KERNELS_MLX (except erfc, which MLX lacks: the scalar kernel).
int moat_kernel_unary(int op, const moat_array* a, moat_array** out);
// a ** b with broadcasting; operands of one type.
int moat_kernel_power(const moat_array* a, const moat_array* b, moat_array** out);
// atan2(a, b) with broadcasting: MLX's op, except f32 on a GPU default
// device, computed in double on the GPU and rounded once.
int moat_kernel_atan2(const moat_array* a, const moat_array* b, moat_array** out);

// -- quantized weights (quant.cpp)
// A quantized weight is one uint8 vector (protocol.md, "Quantized
// weights"): MLX's packed words, scales and (affine) biases of a weight of
// dense `shape` {..., out, in}, the affine scales and biases of type
// `scale_dtype` (f32, f16 or bf16; ignored by the microscaled modes, whose
// scales are uint8). moat_kernels_select's set also picks the CPU kernel of
// the affine x · wᵀ (AVX-512, AVX2 or scalar; MLX's own with
// MOAT_KERNELS_MLX); the GPU runs MLX's, which casts the scales to the
// product's type.
// MLX's quantize (scales and biases computed in f32, the values quantized
// with them), the affine scales and biases then rounded to scale_dtype.
int moat_quantize(const moat_array* w, int group_size, int bits, const char* mode, int scale_dtype,
                  moat_array** out);
// The dense weight, computed in (and of) out_dtype.
int moat_dequantize(const moat_array* packed, const int32_t* shape, size_t ndim, int scale_dtype, int out_dtype,
                    int group_size, int bits, const char* mode, moat_array** out);
int moat_quantized_matmul(const moat_array* x, const moat_array* packed, const int32_t* shape, size_t ndim,
                          int scale_dtype, int group_size, int bits, const char* mode, int transpose,
                          moat_array** out);
// Nullable index arrays are absent.
int moat_gather_qmm(const moat_array* x, const moat_array* packed, const int32_t* shape, size_t ndim, int scale_dtype,
                    int group_size, int bits, const char* mode, const moat_array* lhs_indices,
                    const moat_array* rhs_indices, int transpose, int sorted, moat_array** out);

#ifdef __cplusplus
}
#endif
