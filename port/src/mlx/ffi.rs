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

#[repr(C)]
pub struct moat_compiled {
    _private: [u8; 0],
}

/// `moat_trace_fn` of moat_shim.h: the callback `moat_compile` traces.
#[allow(non_camel_case_types)]
pub type moat_trace_fn = extern "C" fn(
    ctx: *mut c_void,
    ins: *const *mut moat_array,
    n_ins: usize,
    outs: *mut *mut moat_array,
    n_outs: usize,
) -> c_int;

/// `moat_export` of moat_shim.h: where an exported array's bytes are.
#[repr(C)]
pub struct moat_export {
    pub fd: c_int,
    pub file_bytes: usize,
    pub offset: usize,
}

extern "C" {
    pub fn moat_last_error() -> *const c_char;
    pub fn moat_mlx_version() -> *const c_char;

    pub fn moat_kernels_select(want: c_int, selected: *mut c_int) -> c_int;
    pub fn moat_kernel_unary(op: c_int, a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_kernel_power(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_kernel_atan2(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;

    pub fn moat_device_available(device: c_int, out: *mut c_int) -> c_int;
    pub fn moat_set_default_device(device: c_int) -> c_int;
    #[cfg(feature = "fault-injection")]
    pub fn moat_fault_device_write() -> c_int;
    pub fn moat_device_count(device: c_int, out: *mut c_int) -> c_int;
    pub fn moat_device_info(
        device: c_int,
        index: c_int,
        name: *mut c_char,
        name_cap: usize,
        memory: *mut u64,
        cc_major: *mut c_int,
        cc_minor: *mut c_int,
    ) -> c_int;

    pub fn moat_buffer_alloc(nbytes: usize, out: *mut *mut moat_buffer, data: *mut *mut c_void) -> c_int;
    pub fn moat_buffer_free(buf: *mut moat_buffer);
    pub fn moat_array_from_buffer(
        buf: *mut moat_buffer,
        shape: *const i32,
        ndim: usize,
        dtype: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;

    #[allow(clippy::too_many_arguments)]
    pub fn moat_array_from_external(
        data: *mut c_void,
        nbytes: usize,
        room: usize,
        shape: *const i32,
        ndim: usize,
        dtype: c_int,
        release: extern "C" fn(*mut c_void),
        ctx: *mut c_void,
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
    pub fn moat_async_eval_gated(arrays: *const *mut moat_array, n: usize) -> c_int;
    pub fn moat_inline_eval() -> c_int;
    pub fn moat_inline_eval_stats(inlined: *mut u64, forwarded: *mut u64, active: *mut i64);

    pub fn moat_compile(
        trace: moat_trace_fn,
        ctx: *mut c_void,
        id: usize,
        outputs: usize,
        out: *mut *mut moat_compiled,
    ) -> c_int;
    pub fn moat_compiled_call(
        f: *const moat_compiled,
        ins: *const *mut moat_array,
        n_ins: usize,
        outs: *mut *mut moat_array,
        n_outs: usize,
    ) -> c_int;
    pub fn moat_compiled_free(f: *mut moat_compiled);

    // -- memory
    pub fn moat_active_memory() -> usize;
    pub fn moat_peak_memory() -> usize;
    pub fn moat_cache_memory() -> usize;
    pub fn moat_memory_limit() -> usize;
    pub fn moat_reset_peak_memory() -> c_int;
    pub fn moat_set_memory_limit(limit: usize, previous: *mut usize) -> c_int;
    pub fn moat_set_cache_limit(limit: usize, previous: *mut usize) -> c_int;
    pub fn moat_clear_cache() -> c_int;
    pub fn moat_buffer_files_open() -> usize;
    pub fn moat_array_export(a: *const moat_array, seal: c_int, out: *mut moat_export) -> c_int;
    pub fn moat_array_hold(a: *const moat_array) -> c_int;
    pub fn moat_exports_sweep() -> usize;
    pub fn moat_array_unscheduled(a: *const moat_array) -> c_int;
    pub fn moat_array_available(a: *const moat_array) -> c_int;
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
    pub fn moat_view(a: *const moat_array, dtype: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_transpose(a: *const moat_array, axes: *const i32, naxes: usize, out: *mut *mut moat_array) -> c_int;
    pub fn moat_flip(a: *const moat_array, axes: *const i32, naxes: usize, out: *mut *mut moat_array) -> c_int;
    pub fn moat_slice(
        a: *const moat_array,
        start: *const i32,
        stop: *const i32,
        strides: *const i32,
        ndim: usize,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_slice_update(
        src: *const moat_array,
        update: *const moat_array,
        start: *const i32,
        stop: *const i32,
        strides: *const i32,
        ndim: usize,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_concatenate(
        arrays: *const *const moat_array,
        n: usize,
        axis: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_stack(arrays: *const *const moat_array, n: usize, axis: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_where(
        cond: *const moat_array,
        a: *const moat_array,
        b: *const moat_array,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- creation
    pub fn moat_full(
        shape: *const i32,
        ndim: usize,
        value: *const moat_array,
        dtype: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_arange(start: f64, stop: f64, step: f64, dtype: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_eye(n: c_int, m: c_int, k: c_int, dtype: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_pad(
        a: *const moat_array,
        low: *const i32,
        high: *const i32,
        ndim: usize,
        value: *const moat_array,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_as_strided(
        a: *const moat_array,
        shape: *const i32,
        strides: *const i64,
        ndim: usize,
        offset: usize,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_tril(a: *const moat_array, k: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_diagonal(
        a: *const moat_array,
        offset: c_int,
        axis1: c_int,
        axis2: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- element-wise
    pub fn moat_add(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_subtract(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_multiply(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_divide(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_power(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_arctan2(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_minimum(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_maximum(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_bitwise_and(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_bitwise_or(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_bitwise_xor(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_left_shift(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_right_shift(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_equal(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_not_equal(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_greater(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_less(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_greater_equal(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_less_equal(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_logical_and(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_logical_or(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_exp(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_expm1(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_log(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_log1p(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_sigmoid(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_cos(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_sin(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_tan(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_cosh(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_sinh(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_tanh(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_arccos(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_arcsin(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_arctan(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_arccosh(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_arcsinh(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_arctanh(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_sqrt(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_rsqrt(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_erf(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_erfinv(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_abs(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_bitwise_invert(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_ceil(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_floor(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_trunc(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_conjugate(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_negative(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_sign(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_real(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_imag(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_isnan(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_isinf(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_logical_not(a: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_floor_divide(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_remainder(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_isfinite(a: *const moat_array, out: *mut *mut moat_array) -> c_int;

    // -- reductions, cumulative ops and sorting
    pub fn moat_sum(
        a: *const moat_array,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_prod(
        a: *const moat_array,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_max(
        a: *const moat_array,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_min(
        a: *const moat_array,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_all(
        a: *const moat_array,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_any(
        a: *const moat_array,
        axes: *const i32,
        naxes: usize,
        keepdims: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_argmax(a: *const moat_array, axis: c_int, keepdims: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_argmin(a: *const moat_array, axis: c_int, keepdims: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_cumsum(a: *const moat_array, axis: c_int, reverse: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_cumprod(a: *const moat_array, axis: c_int, reverse: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_cummax(a: *const moat_array, axis: c_int, reverse: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_cummin(a: *const moat_array, axis: c_int, reverse: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_sort(a: *const moat_array, axis: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_argsort(a: *const moat_array, axis: c_int, out: *mut *mut moat_array) -> c_int;

    // -- indexing
    pub fn moat_take(a: *const moat_array, indices: *const moat_array, axis: c_int, out: *mut *mut moat_array)
        -> c_int;
    pub fn moat_take_along_axis(
        a: *const moat_array,
        indices: *const moat_array,
        axis: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_scatter(
        a: *const moat_array,
        indices: *const moat_array,
        updates: *const moat_array,
        axis: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_scatter_add(
        a: *const moat_array,
        indices: *const moat_array,
        updates: *const moat_array,
        axis: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_slice_dynamic(
        a: *const moat_array,
        start: *const moat_array,
        axes: *const i32,
        sizes: *const i32,
        n: usize,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_slice_update_dynamic(
        src: *const moat_array,
        update: *const moat_array,
        start: *const moat_array,
        axes: *const i32,
        n: usize,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- linear algebra
    pub fn moat_matmul(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_matvec(
        x: *const moat_array,
        w: *const moat_array,
        transposed: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_qr(a: *const moat_array, outs: *mut *mut moat_array) -> c_int;
    pub fn moat_svd(a: *const moat_array, outs: *mut *mut moat_array) -> c_int;
    pub fn moat_eigh(a: *const moat_array, outs: *mut *mut moat_array) -> c_int;
    pub fn moat_lu(a: *const moat_array, outs: *mut *mut moat_array) -> c_int;
    pub fn moat_cholesky(a: *const moat_array, upper: c_int, out: *mut *mut moat_array) -> c_int;
    pub fn moat_solve(a: *const moat_array, b: *const moat_array, out: *mut *mut moat_array) -> c_int;
    pub fn moat_solve_triangular(
        a: *const moat_array,
        b: *const moat_array,
        upper: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- windows and convolution
    pub fn moat_conv_general(
        input: *const moat_array,
        weight: *const moat_array,
        strides: *const i32,
        pad_lo: *const i32,
        pad_hi: *const i32,
        kernel_dilation: *const i32,
        input_dilation: *const i32,
        n: usize,
        groups: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- fft
    pub fn moat_fftn(
        a: *const moat_array,
        n: *const i32,
        axes: *const i32,
        k: usize,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_ifftn(
        a: *const moat_array,
        n: *const i32,
        axes: *const i32,
        k: usize,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_rfftn(
        a: *const moat_array,
        n: *const i32,
        axes: *const i32,
        k: usize,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_irfftn(
        a: *const moat_array,
        n: *const i32,
        axes: *const i32,
        k: usize,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- fast kernels
    pub fn moat_fast_rms_norm(
        x: *const moat_array,
        weight: *const moat_array,
        eps: f32,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_fast_layer_norm(
        x: *const moat_array,
        weight: *const moat_array,
        bias: *const moat_array,
        eps: f32,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_fast_rope(
        x: *const moat_array,
        dims: c_int,
        traditional: c_int,
        base: f32,
        scale: f32,
        offset: c_int,
        freqs: *const moat_array,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_fast_rope_offsets(
        x: *const moat_array,
        dims: c_int,
        traditional: c_int,
        base: f32,
        scale: f32,
        offset: *const moat_array,
        freqs: *const moat_array,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_fast_attention(
        q: *const moat_array,
        k: *const moat_array,
        v: *const moat_array,
        scale: f32,
        causal: c_int,
        mask: *const moat_array,
        lengths: *const moat_array,
        starts: *const moat_array,
        sinks: *const moat_array,
        out: *mut *mut moat_array,
    ) -> c_int;

    // -- quantized weights
    pub fn moat_quantize(
        w: *const moat_array,
        group_size: c_int,
        bits: c_int,
        mode: *const c_char,
        scale_dtype: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_dequantize(
        packed: *const moat_array,
        shape: *const i32,
        ndim: usize,
        scale_dtype: c_int,
        out_dtype: c_int,
        group_size: c_int,
        bits: c_int,
        mode: *const c_char,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_quantized_matmul(
        x: *const moat_array,
        packed: *const moat_array,
        shape: *const i32,
        ndim: usize,
        scale_dtype: c_int,
        group_size: c_int,
        bits: c_int,
        mode: *const c_char,
        transpose: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
    pub fn moat_gather_qmm(
        x: *const moat_array,
        packed: *const moat_array,
        shape: *const i32,
        ndim: usize,
        scale_dtype: c_int,
        group_size: c_int,
        bits: c_int,
        mode: *const c_char,
        lhs_indices: *const moat_array,
        rhs_indices: *const moat_array,
        transpose: c_int,
        sorted: c_int,
        out: *mut *mut moat_array,
    ) -> c_int;
}
