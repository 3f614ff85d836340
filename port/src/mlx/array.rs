//! Owned handles to MLX arrays and allocator buffers.

use super::{check, ffi, Dtype, Error, Result};
use crate::sys::Mapping;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// An MLX array (a node of a lazy graph until evaluated). Freed on drop.
pub struct Array {
    raw: *mut ffi::moat_array,
}

impl Drop for Array {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim, is non-null and is freed only here.
        unsafe { ffi::moat_array_free(self.raw) }
    }
}

impl Array {
    /// Wraps the out-pointer an op filled, after checking its status.
    pub(super) fn from_call(f: impl FnOnce(*mut *mut ffi::moat_array) -> c_int) -> Result<Array> {
        let mut raw = ptr::null_mut();
        check(f(&mut raw))?;
        if raw.is_null() {
            return Err(Error::new("MLX returned no array"));
        }
        Ok(Array { raw })
    }

    /// Takes ownership of a handle a multi-output shim call wrote.
    pub(super) fn adopt(raw: *mut ffi::moat_array) -> Result<Array> {
        if raw.is_null() {
            return Err(Error::new("MLX returned no array"));
        }
        Ok(Array { raw })
    }

    /// A new array holding a copy of `values` (row-major) with the given shape.
    pub fn from_values<T: Element>(values: &[T], shape: &[i32]) -> Result<Array> {
        let bytes = std::mem::size_of_val(values);
        let mut buffer = Buffer::alloc(bytes)?;
        // SAFETY: `values` is `bytes` bytes of plain numbers.
        let src = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, bytes) };
        buffer.as_mut_slice().copy_from_slice(src);
        buffer.into_array(shape, T::DTYPE)
    }

    /// An array over the bytes of a mapping, without a copy where MLX's
    /// allocator allows it (MLX copies them otherwise). The mapping, and
    /// `keep` with it, is dropped once MLX no longer needs the memory: when
    /// the array and every array sharing its buffer are gone.
    pub fn over_mapping<K: Send + 'static>(mapping: Mapping, keep: K, shape: &[i32], dtype: Dtype) -> Result<Array> {
        let (data, len, room) = (mapping.data(), mapping.len(), mapping.room());
        let owner = Box::into_raw(Box::new((mapping, keep)));
        // SAFETY: `data` points at `len` bytes with `room` writable bytes
        // before them, alive until `release::<K>` drops `owner`; the shim
        // calls it exactly once, whether or not it succeeds.
        Array::from_call(|out| unsafe {
            ffi::moat_array_from_external(
                data.cast(),
                len,
                room,
                shape.as_ptr(),
                shape.len(),
                dtype.code(),
                release::<K>,
                owner.cast(),
                out,
            )
        })
    }

    /// A 0-d array.
    pub fn scalar<T: Element>(value: T) -> Result<Array> {
        Array::from_values(&[value], &[])
    }

    pub(super) fn raw(&self) -> *mut ffi::moat_array {
        self.raw
    }

    /// Gives the handle up to the shim, which frees it.
    pub(super) fn into_raw(self) -> *mut ffi::moat_array {
        let raw = self.raw;
        std::mem::forget(self);
        raw
    }

    /// Another handle to the same array (MLX arrays are shared nodes).
    pub fn share(&self) -> Result<Array> {
        // SAFETY: `self.raw` is live; the shim writes a fresh handle.
        Array::from_call(|out| unsafe { ffi::moat_array_clone(self.raw, out) })
    }

    pub fn shape(&self) -> Vec<i32> {
        // SAFETY: `self.raw` is live; the buffer has exactly ndim slots.
        unsafe {
            let mut shape = vec![0i32; ffi::moat_array_ndim(self.raw)];
            ffi::moat_array_shape(self.raw, shape.as_mut_ptr());
            shape
        }
    }

    pub fn dtype(&self) -> Dtype {
        // SAFETY: `self.raw` is live.
        let code = unsafe { ffi::moat_array_dtype(self.raw) };
        Dtype::from_code(code).expect("MLX returned a dtype the shim does not know")
    }

    pub fn size(&self) -> usize {
        // SAFETY: `self.raw` is live.
        unsafe { ffi::moat_array_size(self.raw) }
    }

    pub fn nbytes(&self) -> usize {
        // SAFETY: `self.raw` is live.
        unsafe { ffi::moat_array_nbytes(self.raw) }
    }

    /// Evaluates the array into one row-major buffer that can be read (and
    /// released) from another thread.
    pub fn evaluate(&self) -> Result<Evaluated> {
        super::eval(&[self])?;
        // SAFETY: `self.raw` is live and evaluated.
        let dense = unsafe { ffi::moat_array_row_contiguous(self.raw) } == 1;
        let array = if dense {
            self.share()?
        } else {
            super::ops::contiguous(self)?
        };
        super::eval(&[&array])?;
        Ok(Evaluated { array })
    }
}

extern "C" fn release<K>(owner: *mut c_void) {
    // SAFETY: `owner` is the box `Array::over_mapping` leaked for this `K`; the shim
    // calls this once, so the box is freed once.
    drop(unsafe { Box::from_raw(owner as *mut (Mapping, K)) });
}

/// An evaluated, row-contiguous array: its bytes are fixed.
pub struct Evaluated {
    array: Array,
}

// SAFETY: the array is evaluated, so no kernel will compute it again, and
// MLX hands an input's buffer to a kernel's output only when a single handle
// holds it, which this one prevents: the bytes stay as they are. The handle
// is a `shared_ptr` (atomic counts) and MLX's allocator frees under a lock,
// so the bytes can be read, and the handle dropped, on another thread.
unsafe impl Send for Evaluated {}

impl Evaluated {
    /// The elements, when `T` is the array's element type.
    pub fn values<T: Element>(&self) -> Option<&[T]> {
        if self.array.dtype() != T::DTYPE {
            return None;
        }
        let bytes = self.bytes();
        if bytes.is_empty() {
            return Some(&[]);
        }
        // SAFETY: MLX buffers are allocated with at least the alignment of any
        // element type, and the bytes hold `len / size_of::<T>()` elements of T.
        Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / std::mem::size_of::<T>()) })
    }

    pub fn bytes(&self) -> &[u8] {
        let n = self.array.nbytes();
        if n == 0 {
            return &[];
        }
        // SAFETY: the array is evaluated and row-contiguous, so `data` points at
        // `nbytes` initialised bytes that live as long as `self.array`.
        unsafe { std::slice::from_raw_parts(ffi::moat_array_data(self.array.raw) as *const u8, n) }
    }

    pub fn array(&self) -> &Array {
        &self.array
    }

    /// The memory file that holds these bytes (a large buffer of MLX's CPU
    /// allocator, port/shim/alloc.cpp), made read-only and, with `seal`,
    /// sealed against writes, shrinking and growing, for good; `None` where
    /// the bytes are in no such file (a small tensor, an upload, a GPU
    /// worker). The worker holds the buffer from now on until nothing else
    /// does (`memory::sweep_exports`), so MLX never writes into it again.
    pub fn export(&self, seal: bool) -> Result<Option<Exported>> {
        let mut out = ffi::moat_export {
            fd: -1,
            file_bytes: 0,
            offset: 0,
        };
        // SAFETY: `self.array.raw` is live and evaluated; `out` is a valid
        // out-pointer for the call.
        check(unsafe { ffi::moat_array_export(self.array.raw, c_int::from(seal), &mut out) })?;
        Ok((out.fd >= 0).then_some(Exported {
            fd: out.fd,
            file_bytes: out.file_bytes,
            offset: out.offset,
        }))
    }
}

impl Evaluated {
    /// Holds the buffer as an exported one (see `export`) until nothing
    /// else holds it: for bytes exported from elsewhere (an upload's file).
    pub fn hold(&self) -> Result<()> {
        // SAFETY: `self.array.raw` is live and evaluated.
        check(unsafe { ffi::moat_array_hold(self.array.raw) })
    }
}

/// Where an exported tensor's bytes are (`Evaluated::export`): the file's
/// descriptor in this process (open while the buffer lives), the file's
/// size, and the bytes' offset in it.
#[derive(Debug, Clone, Copy)]
pub struct Exported {
    pub fd: std::os::fd::RawFd,
    pub file_bytes: usize,
    pub offset: usize,
}

/// Memory from MLX's allocator that a caller fills before an array adopts it.
pub struct Buffer {
    raw: *mut ffi::moat_buffer,
    data: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory from MLX's thread-safe allocator, owned
// by exactly one `Buffer`; it is filled on the reader thread and adopted on
// the session thread.
unsafe impl Send for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: not yet adopted by an array, so we still own it.
            unsafe { ffi::moat_buffer_free(self.raw) }
        }
    }
}

impl Buffer {
    /// Allocates `len` bytes; MLX's CPU allocator returns NULL on failure,
    /// which becomes an error here instead of a crash later.
    pub fn alloc(len: usize) -> Result<Buffer> {
        let mut raw = ptr::null_mut();
        let mut data: *mut c_void = ptr::null_mut();
        // SAFETY: both out-pointers are valid for the call.
        check(unsafe { ffi::moat_buffer_alloc(len, &mut raw, &mut data) })
            .map_err(|e| Error::new(format!("cannot allocate {len} bytes: {e}")))?;
        Ok(Buffer {
            raw,
            data: data as *mut u8,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `data` points at `len` bytes we own exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }

    /// Hands the memory to a new array of the given shape and type, which
    /// must hold exactly `len` bytes (MLX reads as many as the shape says).
    pub fn into_array(mut self, shape: &[i32], dtype: Dtype) -> Result<Array> {
        let bytes = shape.iter().try_fold(dtype.size(), |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
        });
        if bytes != Some(self.len) {
            return Err(Error::new(format!(
                "{} bytes cannot hold an array of shape {shape:?} and type {:?}",
                self.len,
                dtype.nx()
            )));
        }
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: the shim takes ownership of `raw` whether or not it succeeds.
        Array::from_call(|out| unsafe {
            ffi::moat_array_from_buffer(raw, shape.as_ptr(), shape.len(), dtype.code(), out)
        })
    }
}

/// Plain numbers that MLX holds under a fixed dtype.
pub trait Element: Copy + 'static {
    const DTYPE: Dtype;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: Dtype = Dtype::$d;
        }
    )*};
}

element! { u8 => U8, u16 => U16, u32 => U32, u64 => U64, i8 => S8, i16 => S16, i32 => S32, i64 => S64, f32 => F32, f64 => F64 }
