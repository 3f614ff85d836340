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
int moat_device_available(int device, int* out);
int moat_set_default_device(int device);

// Buffers from MLX's allocator, filled by the caller, then adopted by an array.
int moat_buffer_alloc(size_t nbytes, moat_buffer** out, void** data);
void moat_buffer_free(moat_buffer* buf);
int moat_array_from_buffer(moat_buffer* buf, const int32_t* shape, size_t ndim,
                           int dtype, moat_array** out);

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
int moat_async_eval(moat_array* const* arrays, size_t n);

// Memory (memory.cpp): MLX's allocator statistics and limits.
size_t moat_active_memory(void);
size_t moat_peak_memory(void);
size_t moat_cache_memory(void);
size_t moat_memory_limit(void);
int moat_reset_peak_memory(void);
int moat_set_memory_limit(size_t limit, size_t* previous);
int moat_set_cache_limit(size_t limit, size_t* previous);
int moat_clear_cache(void);
// The lazy graph behind an array: its status, identity, op, inputs and
// siblings (handles written to *out are new and owned by the caller).
int moat_array_unscheduled(const moat_array* a);
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

// -- element-wise (elementwise.cpp)
int moat_add(const moat_array* a, const moat_array* b, moat_array** out);
int moat_subtract(const moat_array* a, const moat_array* b, moat_array** out);
int moat_multiply(const moat_array* a, const moat_array* b, moat_array** out);
int moat_divide(const moat_array* a, const moat_array* b, moat_array** out);

// -- reductions (reduction.cpp)
int moat_sum(const moat_array* a, const int32_t* axes, size_t naxes, int keepdims,
             moat_array** out);

// -- indexing (indexing.cpp)

// -- linear algebra (linalg.cpp)
int moat_matmul(const moat_array* a, const moat_array* b, moat_array** out);

// -- windows and convolution (window.cpp)

// -- fft (fft.cpp)

#ifdef __cplusplus
}
#endif
