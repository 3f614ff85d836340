//! Convolution and window reductions with Nx's semantics.
//!
//! Windows are strided views (`as_strided`) of the padded input, copied out
//! and reduced over their window axes. Views are computed from shapes the
//! builder checks, so they never reach outside the padded array.

use super::compose::{complex, count, expand, inverse};
use super::convert::{float_scalar, int_scalar};
use super::{attrs, finish, to_out_type, Outputs};
use crate::mlx::ops::ConvSpec;
use crate::mlx::{ops, Array, Dtype, Result};
use crate::term::Term;

// -- convolution

/// `conv(input, kernel)` with Nx's options: input `[N, C, spatial...]` and
/// kernel `[O, C / groups, spatial...]` after their permutations, output
/// `[N / batch_groups, O, spatial...]` before the output permutation.
pub fn conv(x: &[&Array], a: &Term) -> Outputs {
    // Half floats accumulate in f32 and round once, as Nx's do.
    let work = |t: &Array| -> Result<Array> {
        match t.dtype() {
            Dtype::F16 | Dtype::Bf16 => ops::astype(t, Dtype::F32),
            _ => t.share(),
        }
    };
    let perm = |key, t: &Array| attrs::permutation(attrs::field(a, key)?, t.shape().len());
    let (input, kernel) = (to_out_type(x[0], a)?, to_out_type(x[1], a)?);
    let input = ops::transpose(&work(&input)?, &perm("input_permutation", &input)?)?;
    let kernel = ops::transpose(&work(&kernel)?, &perm("kernel_permutation", &kernel)?)?;
    let positive = |key| attrs::positive(attrs::field(a, key)?);
    let (fg, bg) = (positive("feature_group_size")?, positive("batch_group_size")?);
    let shape = input.shape();
    let rank = shape.len();
    if rank < 3 {
        return Err(format!("conv needs spatial axes, got input shape {shape:?}"));
    }
    let spatial = rank - 2;
    let padding = pairs(attrs::field(a, "padding")?)?;
    let positives = |key| attrs::positives(attrs::field(a, key)?);
    let strides = positives("strides")?;
    let mut input_dilation = positives("input_dilation")?;
    let mut kernel_dilation = positives("kernel_dilation")?;
    if [
        padding.len(),
        strides.len(),
        input_dilation.len(),
        kernel_dilation.len(),
    ]
    .iter()
    .any(|l| *l != spatial)
    {
        return Err(format!("one padding, stride and dilation per spatial axis ({spatial})"));
    }
    // Batch groups: batch chunk g meets output features of group g, which
    // is a feature-grouped convolution once the chunks sit side by side as
    // channels: [N, C, s...] -> [g, N/g, C, s...] -> [N/g, g*C, s...].
    let (input, groups) = if bg > 1 {
        let (n, c) = (shape[0], shape[1]);
        let split = ops::reshape(&input, &[&[bg, n / bg, c][..], &shape[2..]].concat())?;
        let mut perm: Vec<i32> = (0..rank as i32 + 1).collect();
        perm.swap(0, 1);
        let moved = ops::transpose(&split, &perm)?;
        (
            ops::reshape(&moved, &[&[n / bg, bg * c][..], &shape[2..]].concat())?,
            bg,
        )
    } else {
        (input, fg)
    };
    // MLX's f64 convolution has no dilated kernels, and MLX 0.32.4's CUDA
    // convolution returns wrong values with input dilation or with more
    // padding before than after under strides (README, "GPU"): dilate
    // explicitly there, and on the GPU pad explicitly too (below), so MLX
    // sees strides and groups only.
    let explicit = input.dtype() == Dtype::F64 || crate::mlx::on_gpu();
    let (input, kernel) = if explicit {
        let (mut input, mut kernel) = (input, kernel);
        for axis in 0..spatial {
            input = dilate(&input, axis as i32 + 2, input_dilation[axis])?;
            kernel = dilate(&kernel, axis as i32 + 2, kernel_dilation[axis])?;
        }
        input_dilation = vec![1; spatial];
        kernel_dilation = vec![1; spatial];
        (input, kernel)
    } else {
        (input, kernel)
    };
    // MLX wants channels last and no negative padding; negative padding
    // crops the (dilated) input first.
    let (input, input_dilation, padding) = crop_negative_padding(&input, &input_dilation, &padding)?;
    let (input, padding) = if crate::mlx::on_gpu() {
        pad_explicitly(&input, &padding)?
    } else {
        (input, padding)
    };
    let channels_last: Vec<i32> = [&[0][..], &(2..rank as i32).collect::<Vec<_>>(), &[1]].concat();
    let (input, kernel) = (
        ops::transpose(&input, &channels_last)?,
        ops::transpose(&kernel, &channels_last)?,
    );
    let (lo, hi): (Vec<i32>, Vec<i32>) = padding.iter().copied().unzip();
    let spec = ConvSpec {
        strides: &strides,
        pad_lo: &lo,
        pad_hi: &hi,
        kernel_dilation: &kernel_dilation,
        input_dilation: &input_dilation,
        groups,
    };
    let result = if input.dtype() == Dtype::C64 {
        complex_conv(&input, &kernel, &spec)?
    } else {
        grouped_conv(&input, &kernel, &spec)?
    };
    let channels_first: Vec<i32> = [&[0, rank as i32 - 1][..], &(1..rank as i32 - 1).collect::<Vec<_>>()].concat();
    let nx_layout = ops::transpose(&result, &channels_first)?;
    let output_permutation = perm("output_permutation", &nx_layout)?;
    finish(ops::transpose(&nx_layout, &inverse(&output_permutation)?), a)
}

/// MLX convolves real types only: (a + bi) * (c + di) = (ac - bd) + (ad + bc)i.
fn complex_conv(input: &Array, kernel: &Array, spec: &ConvSpec) -> Result<Array> {
    let (ir, ii) = (ops::real(input)?, ops::imag(input)?);
    let (kr, ki) = (ops::real(kernel)?, ops::imag(kernel)?);
    let re = ops::subtract(&grouped_conv(&ir, &kr, spec)?, &grouped_conv(&ii, &ki, spec)?)?;
    let im = ops::add(&grouped_conv(&ir, &ki, spec)?, &grouped_conv(&ii, &kr, spec)?)?;
    complex(&re, &im)
}

/// MLX convolves groups only in 1 or 2 spatial dimensions, and not in f64:
/// otherwise each group's channels are convolved with its filters and the
/// outputs concatenated (channels last).
fn grouped_conv(input: &Array, kernel: &Array, spec: &ConvSpec) -> Result<Array> {
    let native = input.shape().len() <= 4 && input.dtype() != Dtype::F64;
    if spec.groups <= 1 || native {
        return ops::conv_general(input, kernel, spec);
    }
    let (ishape, kshape) = (input.shape(), kernel.shape());
    let (c, o) = (ishape[ishape.len() - 1] / spec.groups, kshape[0] / spec.groups);
    let single = ConvSpec { groups: 1, ..*spec };
    let outputs = (0..spec.groups)
        .map(|g| {
            let part = slice_axis(input, ishape.len() - 1, g * c, c)?;
            let filters = slice_axis(kernel, 0, g * o, o)?;
            ops::conv_general(&part, &filters, &single)
        })
        .collect::<Result<Vec<Array>>>()?;
    ops::concatenate(&outputs.iter().collect::<Vec<_>>(), -1)
}

fn slice_axis(x: &Array, axis: usize, start: i32, len: i32) -> Result<Array> {
    let shape = x.shape();
    let mut lo = vec![0; shape.len()];
    let mut hi = shape.clone();
    lo[axis] = start;
    hi[axis] = start + len;
    ops::slice(x, &lo, &hi, &vec![1; shape.len()])
}

/// Low and high padding per spatial axis.
type Padding = Vec<(i32, i32)>;

/// With any negative padding, the input is dilated explicitly and cropped,
/// leaving MLX a dilation of 1 and non-negative padding.
fn crop_negative_padding(
    input: &Array,
    dilation: &[i32],
    padding: &[(i32, i32)],
) -> Result<(Array, Vec<i32>, Padding)> {
    if padding.iter().all(|&(lo, hi)| lo >= 0 && hi >= 0) {
        return Ok((input.share()?, dilation.to_vec(), padding.to_vec()));
    }
    let mut x = input.share()?;
    for (i, &d) in dilation.iter().enumerate() {
        x = dilate(&x, i as i32 + 2, d)?;
    }
    let shape = x.shape();
    let mut start = vec![0; shape.len()];
    let mut stop = shape.clone();
    for (i, &(lo, hi)) in padding.iter().enumerate() {
        start[i + 2] = (-lo).max(0).min(shape[i + 2]);
        stop[i + 2] = (shape[i + 2] + hi.min(0)).max(start[i + 2]);
    }
    let cropped = ops::slice(&x, &start, &stop, &vec![1; shape.len()])?;
    let padding = padding.iter().map(|&(lo, hi)| (lo.max(0), hi.max(0))).collect();
    Ok((cropped, vec![1; dilation.len()], padding))
}

/// The input `[N, C, spatial...]` with its spatial padding applied as
/// zeros, and no padding left for the convolution.
fn pad_explicitly(input: &Array, padding: &[(i32, i32)]) -> Result<(Array, Padding)> {
    let all: Padding = [(0, 0), (0, 0)].into_iter().chain(padding.iter().copied()).collect();
    let zero = ops::astype(&Array::scalar(0i32)?, input.dtype())?;
    Ok((pad_or_crop(input, &all, &zero)?, vec![(0, 0); padding.len()]))
}

/// `d - 1` zeros between neighbours along `axis`.
fn dilate(x: &Array, axis: i32, d: i32) -> Result<Array> {
    let shape = x.shape();
    let n = shape[axis as usize];
    if d <= 1 || n <= 1 {
        return x.share();
    }
    let spread = expand(x, axis + 1)?;
    let rank = spread.shape().len();
    let mut high = vec![0; rank];
    high[axis as usize + 1] = d - 1;
    let zero = ops::astype(&Array::scalar(0i32)?, x.dtype())?;
    let padded = ops::pad(&spread, &vec![0; rank], &high, &zero)?;
    let mut merged = shape.clone();
    merged[axis as usize] = n * d;
    let flat = ops::reshape(&padded, &merged)?;
    let mut stop = merged.clone();
    stop[axis as usize] = (n - 1) * d + 1;
    ops::slice(&flat, &vec![0; merged.len()], &stop, &vec![1; merged.len()])
}

// -- window reductions

#[derive(Clone, Copy)]
enum Reduce {
    Sum,
    Product,
    Max,
    Min,
}

pub fn window_sum(x: &[&Array], a: &Term) -> Outputs {
    window_reduce(x, a, Reduce::Sum)
}

pub fn window_product(x: &[&Array], a: &Term) -> Outputs {
    window_reduce(x, a, Reduce::Product)
}

pub fn window_max(x: &[&Array], a: &Term) -> Outputs {
    window_reduce(x, a, Reduce::Max)
}

pub fn window_min(x: &[&Array], a: &Term) -> Outputs {
    window_reduce(x, a, Reduce::Min)
}

/// Reduces each window of `window_dimensions` (with `strides`,
/// `window_dilations` and `padding`); padding holds the reduction's identity
/// (the type's lowest value for max, its highest for min), as in Nx.
fn window_reduce(x: &[&Array], a: &Term, reduce: Reduce) -> Outputs {
    let tensor = to_out_type(x[0], a)?;
    let dtype = tensor.dtype();
    let dims = attrs::ints(attrs::field(a, "window_dimensions")?)?;
    let strides = attrs::ints(attrs::field(a, "strides")?)?;
    let dilations = attrs::ints(attrs::field(a, "window_dilations")?)?;
    let padding = pairs(attrs::field(a, "padding")?)?;
    let fill = match reduce {
        Reduce::Sum => int_scalar(0, dtype)?,
        Reduce::Product => int_scalar(1, dtype)?,
        Reduce::Max => extreme(dtype, false)?,
        Reduce::Min => extreme(dtype, true)?,
    };
    let padded = pad_or_crop(&tensor, &padding, &fill)?;
    let windows = Windows::new(&padded.shape(), &dims, &strides, &dilations)?;
    let view = windows.view(&windows.fit(&padded, &fill)?)?;
    let axes: Vec<i32> = (dims.len() as i32..2 * dims.len() as i32).collect();
    let reduced = match reduce {
        Reduce::Sum => ops::sum(&view, &axes, false),
        Reduce::Product => ops::prod(&view, &axes, false),
        Reduce::Max => ops::max(&view, &axes, false),
        Reduce::Min => ops::min(&view, &axes, false),
    };
    finish(reduced, a)
}

/// The largest (`high`) or lowest value of a type: infinities for floats.
fn extreme(dtype: Dtype, high: bool) -> Result<Array> {
    let value = |lo: i64, hi: i64| int_scalar(if high { hi } else { lo }, dtype);
    match dtype {
        Dtype::U8 => value(0, u8::MAX as i64),
        Dtype::U16 => value(0, u16::MAX as i64),
        Dtype::U32 => value(0, u32::MAX as i64),
        Dtype::U64 => ops::astype(&Array::scalar(if high { u64::MAX } else { 0 })?, dtype),
        Dtype::S8 => value(i8::MIN as i64, i8::MAX as i64),
        Dtype::S16 => value(i16::MIN as i64, i16::MAX as i64),
        Dtype::S32 => value(i32::MIN as i64, i32::MAX as i64),
        Dtype::S64 => value(i64::MIN, i64::MAX),
        Dtype::Bool => value(0, 1),
        _ => float_scalar(if high { f64::INFINITY } else { f64::NEG_INFINITY }, dtype),
    }
}

/// `padding` `[{lo, hi}]` applied with `fill`; negative amounts crop.
fn pad_or_crop(x: &Array, padding: &[(i32, i32)], fill: &Array) -> Result<Array> {
    let shape = x.shape();
    if padding.len() != shape.len() {
        return Err(crate::mlx::Error::new(format!(
            "one padding pair per axis of shape {shape:?}"
        )));
    }
    let (lo, hi): (Vec<i32>, Vec<i32>) = padding.iter().map(|&(l, h)| (l.max(0), h.max(0))).unzip();
    let padded = if lo.iter().chain(&hi).any(|&p| p > 0) {
        ops::pad(x, &lo, &hi, fill)?
    } else {
        x.share()?
    };
    if padding.iter().all(|&(l, h)| l >= 0 && h >= 0) {
        return Ok(padded);
    }
    let pshape = padded.shape();
    let start: Vec<i32> = padding
        .iter()
        .zip(&pshape)
        .map(|(&(l, _), &d)| (-l).clamp(0, d))
        .collect();
    let stop: Vec<i32> = padding
        .iter()
        .zip(&pshape)
        .zip(&start)
        .map(|((&(_, h), &d), &s)| (d + h.min(0)).max(s))
        .collect();
    ops::slice(&padded, &start, &stop, &vec![1; pshape.len()])
}

/// The windows of an array of `shape`: `[out..., window...]`.
///
/// Nx counts windows per axis as `div(size - span, stride) + 1` with
/// truncating division, so a last window may overhang the (padded) array by
/// less than a stride; it sees the padding value there (`fit`).
struct Windows {
    out: Vec<i32>,
    dims: Vec<i32>,
    strides: Vec<i32>,
    dilations: Vec<i32>,
    overhang: Vec<i32>,
}

impl Windows {
    fn new(shape: &[i32], dims: &[i32], strides: &[i32], dilations: &[i32]) -> Result<Windows> {
        let rank = shape.len();
        if dims.len() != rank || strides.len() != rank || dilations.len() != rank {
            return Err(crate::mlx::Error::new(format!(
                "one window size, stride and dilation per axis of {shape:?}"
            )));
        }
        if dims.iter().chain(strides).chain(dilations).any(|&v| v < 1) {
            return Err(crate::mlx::Error::new(
                "window sizes, strides and dilations must be positive",
            ));
        }
        let span = |i: usize| (dims[i] - 1) * dilations[i] + 1;
        // Rust's `/` truncates like Elixir's `div`.
        let out: Vec<i32> = (0..rank)
            .map(|i| ((shape[i] - span(i)) / strides[i] + 1).max(0))
            .collect();
        let overhang = (0..rank)
            .map(|i| {
                if out[i] == 0 {
                    0
                } else {
                    ((out[i] - 1) * strides[i] + span(i) - shape[i]).max(0)
                }
            })
            .collect();
        Ok(Windows {
            out,
            dims: dims.to_vec(),
            strides: strides.to_vec(),
            dilations: dilations.to_vec(),
            overhang,
        })
    }

    /// `padded` extended with `fill` where the last windows overhang it.
    fn fit(&self, padded: &Array, fill: &Array) -> Result<Array> {
        if self.overhang.iter().all(|&o| o == 0) {
            return padded.share();
        }
        ops::pad(padded, &vec![0; self.overhang.len()], &self.overhang, fill)
    }

    /// `[out..., window...]` view of a row-major array that holds them all.
    fn view(&self, padded: &Array) -> Result<Array> {
        let shape = padded.shape();
        let rank = shape.len();
        let mut elements = vec![1i64; rank];
        for i in (0..rank.saturating_sub(1)).rev() {
            elements[i] = elements[i + 1] * shape[i + 1] as i64;
        }
        // as_strided does not check bounds: the view must fit.
        let fits = (0..rank).all(|i| {
            let last = (self.out[i] as i64 - 1) * self.strides[i] as i64
                + (self.dims[i] as i64 - 1) * self.dilations[i] as i64;
            self.out[i] == 0 || last < shape[i] as i64
        });
        if shape.len() != self.out.len() || !fits {
            return Err(crate::mlx::Error::new(format!(
                "windows {:?} do not fit shape {shape:?}",
                self.dims
            )));
        }
        if count(&self.out) == 0 {
            let shape = [self.out.clone(), self.dims.clone()].concat();
            let zero = ops::astype(&Array::scalar(0i32)?, padded.dtype())?;
            return ops::broadcast_to(&zero, &shape);
        }
        let shape = [self.out.clone(), self.dims.clone()].concat();
        let strides: Vec<i64> = (0..rank)
            .map(|i| elements[i] * self.strides[i] as i64)
            .chain((0..rank).map(|i| elements[i] * self.dilations[i] as i64))
            .collect();
        // as_strided reads the array's buffer, so that must be row-major;
        // the view is copied out because MLX's reductions misread some
        // overlapping views (measured: prod over a dilated window view).
        let dense = ops::contiguous(padded)?;
        // SAFETY: `dense` is row-contiguous and `fits` checked that the last
        // element of every window lies inside it.
        ops::contiguous(&unsafe { ops::as_strided(&dense, &shape, &strides, 0) }?)
    }
}

// -- select and scatter

pub fn window_scatter_max(x: &[&Array], a: &Term) -> Outputs {
    window_scatter(x, a, true)
}

pub fn window_scatter_min(x: &[&Array], a: &Term) -> Outputs {
    window_scatter(x, a, false)
}

/// `window_scatter_max|min(tensor, source, init)`: in each window of the
/// tensor (padded with `init`) the last position holding the window's max
/// (min) receives that window's `source` value; positions add up what they
/// receive onto `init`. Padding positions receive nothing.
fn window_scatter(x: &[&Array], a: &Term, max: bool) -> Outputs {
    let (tensor, source) = (x[0], to_out_type(x[1], a)?);
    let init = to_out_type(x[2], a)?;
    let dims = attrs::ints(attrs::field(a, "window_dimensions")?)?;
    let strides = attrs::ints(attrs::field(a, "strides")?)?;
    let padding = pairs(attrs::field(a, "padding")?)?;
    if padding.iter().any(|&(lo, hi)| lo < 0 || hi < 0) {
        return Err("window_scatter: negative padding is not supported".into());
    }
    let shape = tensor.shape();
    let rank = shape.len();
    let fill = ops::astype(&init, tensor.dtype())?;
    let padded = pad_or_crop(tensor, &padding, &fill)?;
    let windows = Windows::new(&padded.shape(), &dims, &strides, &vec![1; rank])?;
    let padded = windows.fit(&padded, &fill)?;
    if windows.out != source.shape() {
        return Err(format!(
            "source shape {:?} differs from the window grid {:?}",
            source.shape(),
            windows.out
        ));
    }
    let window_size: i32 = dims.iter().product();
    let flat_windows = ops::reshape(
        &windows.view(&padded)?,
        &[windows.out.clone(), vec![window_size]].concat(),
    )?;
    // The last best position: the first of the reversed window.
    let reversed = ops::flip(&flat_windows, &[-1])?;
    let first = if max {
        ops::argmax(&reversed, -1, false)?
    } else {
        ops::argmin(&reversed, -1, false)?
    };
    let within = ops::subtract(
        &int_scalar(window_size as i64 - 1, Dtype::S32)?,
        &ops::astype(&first, Dtype::S32)?,
    )?;
    // Window position -> coordinates in the unpadded tensor.
    let mut linear = int_scalar(0, Dtype::S32)?;
    let mut inside = ops::astype(&Array::scalar(1u8)?, Dtype::Bool)?;
    let mut tail = window_size;
    for axis in 0..rank {
        tail /= dims[axis];
        let offset = ops::remainder(
            &ops::floor_divide(&within, &int_scalar(tail as i64, Dtype::S32)?)?,
            &int_scalar(dims[axis] as i64, Dtype::S32)?,
        )?;
        let anchors: Vec<i32> = (0..windows.out[axis])
            .map(|o| o * strides[axis] - padding[axis].0)
            .collect();
        let mut anchor_shape = vec![1; rank];
        anchor_shape[axis] = windows.out[axis];
        let coord = ops::add(&Array::from_values(&anchors, &anchor_shape)?, &offset)?;
        let ok = ops::logical_and(
            &ops::logical_not(&ops::less(&coord, &int_scalar(0, Dtype::S32)?)?)?,
            &ops::less(&coord, &int_scalar(shape[axis] as i64, Dtype::S32)?)?,
        )?;
        inside = ops::logical_and(&inside, &ok)?;
        linear = ops::add(
            &ops::multiply(&linear, &int_scalar(shape[axis] as i64, Dtype::S32)?)?,
            &coord,
        )?;
    }
    // Windows whose choice falls in the padding add zero at position 0.
    let zero = ops::astype(&Array::scalar(0i32)?, source.dtype())?;
    let values = ops::where_(&inside, &source, &zero)?;
    let linear = ops::where_(&inside, &linear, &int_scalar(0, Dtype::S32)?)?;
    let n = count(&windows.out) as i32;
    let total = count(&shape) as i32;
    let base = ops::broadcast_to(&ops::reshape(&init, &[1])?, &[total])?;
    if n == 0 || total == 0 {
        return finish(ops::reshape(&base, &shape), a);
    }
    // SAFETY: `linear` is a position inside the tensor (`inside`), or 0.
    let scattered = unsafe {
        ops::scatter_add(
            &base,
            &ops::reshape(&linear, &[n])?,
            &ops::reshape(&values, &[n, 1])?,
            0,
        )
    }?;
    finish(ops::reshape(&scattered, &shape), a)
}

/// `[[lo, hi], ...]` or `[{lo, hi}, ...]`.
fn pairs(t: &Term) -> std::result::Result<Vec<(i32, i32)>, String> {
    let list = t
        .as_list()
        .ok_or_else(|| format!("expected a list of {{lo, hi}} pairs, got {t}"))?;
    list.iter()
        .map(|p| match p.as_list().or_else(|| p.as_tuple()) {
            Some([lo, hi]) => Ok((attrs::int(lo)?, attrs::int(hi)?)),
            _ => Err(format!("expected a {{lo, hi}} pair, got {p}")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Input and kernel shapes (channels last), stride, input dilation, padding.
    type Case = (&'static [i32], &'static [i32], i32, i32, (i32, i32));

    fn values(shape: &[i32], seed: i32) -> Array {
        let n: i32 = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i * 7 + seed) % 19 - 9) as f32 / 2.0).collect();
        Array::from_values(&v, shape).unwrap()
    }

    fn read(x: &Array) -> Vec<f32> {
        x.evaluate().unwrap().values::<f32>().unwrap().to_vec()
    }

    // What the GPU path sends MLX (explicit dilation and padding, strides
    // only) equals MLX's own dilated, padded convolution, on the CPU.
    #[test]
    fn explicit_dilation_and_padding_convolve_as_mlx_does() {
        crate::mlx::Device::Cpu.make_default().unwrap();
        let cases: [Case; 5] = [
            (&[2, 3, 1], &[1, 1, 1], 2, 2, (2, 0)),
            (&[2, 3, 1], &[1, 1, 1], 2, 1, (2, 0)),
            (&[1, 6, 2], &[2, 2, 2], 2, 1, (1, 0)),
            (&[3, 2, 2], &[2, 2, 2], 2, 2, (0, 0)),
            (&[1, 5, 1], &[1, 3, 1], 1, 2, (0, 3)),
        ];
        for (i, (ishape, kshape, stride, dilation, (lo, hi))) in cases.into_iter().enumerate() {
            let (input, kernel) = (values(ishape, i as i32), values(kshape, 3));
            let mlx = ConvSpec {
                strides: &[stride],
                pad_lo: &[lo],
                pad_hi: &[hi],
                kernel_dilation: &[1],
                input_dilation: &[dilation],
                groups: 1,
            };
            let expected = read(&ops::conv_general(&input, &kernel, &mlx).unwrap());
            // Channels last here: the helpers take [N, C, spatial...].
            let first = ops::transpose(&input, &[0, 2, 1]).unwrap();
            let dilated = dilate(&first, 2, dilation).unwrap();
            let (padded, none) = pad_explicitly(&dilated, &[(lo, hi)]).unwrap();
            assert_eq!(none, vec![(0, 0)]);
            let last = ops::transpose(&padded, &[0, 2, 1]).unwrap();
            let plain = ConvSpec {
                pad_lo: &[0],
                pad_hi: &[0],
                input_dilation: &[1],
                ..mlx
            };
            assert_eq!(
                read(&ops::conv_general(&last, &kernel, &plain).unwrap()),
                expected,
                "case {i}"
            );
        }
    }
}
