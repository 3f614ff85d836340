//! Raw declarations of the C++ shim (port/shim/moat_shim.h). Nothing outside
//! `crate::mlx` calls these; `Array` and friends are the safe surface.

use std::os::raw::{c_char, c_int, c_void};

pub const MOAT_OK: c_int = 0;

#[repr(C)]
pub struct moat_array {
    _private: [u8; 0],
}

#[repr(C)]
pub struct moat_buffer {
    _private: [u8; 0],
}

extern "C" {
    pub fn moat_last_error() -> *const c_char;
    pub fn moat_mlx_version() -> *const c_char;

    pub fn moat_device_available(device: c_int, out: *mut c_int) -> c_int;
    pub fn moat_set_default_device(device: c_int) -> c_int;

    pub fn moat_buffer_alloc(nbytes: usize, out: *mut *mut moat_buffer, data: *mut *mut c_void) -> c_int;
    pub fn moat_buffer_free(buf: *mut moat_buffer);
    pub fn moat_array_from_buffer(
        buf: *mut moat_buffer,
        shape: *const i32,
        ndim: usize,
        dtype: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;

    pub fn moat_array_free(a: *mut moat_array);
    pub fn moat_array_clone(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_array_ndim(a: *const moat_array) -> usize;
    pub fn moat_array_shape(a: *const moat_array, out: *mut i32);
    pub fn moat_array_dtype(a: *const moat_array) -> c_int;
    pub fn moat_array_size(a: *const moat_array) -> usize;
    pub fn moat_array_nbytes(a: *const moat_array) -> usize;
    pub fn moat_array_row_contiguous(a: *const moat_array) -> c_int;
    pub fn moat_array_data(a: *const moat_array) -> *const c_void;

    pub fn moat_eval(arrays: *const *mut moat_array, n: usize) -> c_int;
    pub fn moat_async_eval(arrays: *const *mut moat_array, n: usize) -> c_int;

    // -- memory
    pub fn moat_active_memory() -> usize;
    pub fn moat_peak_memory() -> usize;
    pub fn moat_cache_memory() -> usize;
    pub fn moat_memory_limit() -> usize;
    pub fn moat_reset_peak_memory() -> c_int;
    pub fn moat_set_memory_limit(limit: usize, previous: *mut usize) -> c_int;
    pub fn moat_set_cache_limit(limit: usize, previous: *mut usize) -> c_int;
    pub fn moat_clear_cache() -> c_int;
    pub fn moat_array_unscheduled(a: *const moat_array) -> c_int;
    pub fn moat_array_id(a: *const moat_array) -> usize;
    pub fn moat_array_primitive(a: *const moat_array) -> *const c_char;
    pub fn moat_array_num_inputs(a: *const moat_array) -> usize;
    pub fn moat_array_input(a: *const moat_array, i: usize, out: *mut *mut moat_array) -> c_int;
    pub fn moat_array_num_siblings(a: *const moat_array) -> usize;
    pub fn moat_array_sibling(a: *const moat_array, i: usize, out: *mut *mut moat_array) -> c_int;

    // -- shape and type
    pub fn moat_astype(a: *const moat_array, dtype: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_contiguous(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_reshape(a: *const moat_array, shape: *const i32, ndim: usize, out: *mut *mut moat_array) -> c_int;
    pub fn moat_broadcast_to(a: *const moat_array, shape: *const i32, ndim: usize, out: *mut *mut moat_array) -> c_int;

    // -- element-wise
    pub fn moat_add(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_subtract(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_multiply(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_divide(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;

    // -- reductions
    pub fn moat_sum(
        a: *const moat_array,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- indexing

    // -- linear algebra
    pub fn moat_matmul(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;

    // -- windows and convolution

    // -- fft
}
