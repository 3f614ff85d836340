//! Quantized weights through real frames: `quantize` packs MLX's three
//! arrays into one vector of the documented size, `dequantize` reads it back,
//! and `quantized_matmul` (the worker's own CPU kernel, AVX-512, AVX2 and
//! the scalar fallback forced by MOAT_CPU_FEATURES, and MLX's) agrees with
//! dequantize-then-multiply in f32, for every bit width and group size, odd
//! row counts, batched, strided, broadcast and empty inputs, and half-width
//! scales; mismatched descriptions fail the op with the cause. On a GPU
//! worker both sides run on the card, and its f32 products are full f32 (the
//! worker's default: it sets MLX_ENABLE_TF32=0 unless told otherwise; TF32
//! would be 10-bit-mantissa inputs, 2.5e-3 of the scale off), so the same
//! tolerance holds there.

mod common;

use common::*;
use moat_port::protocol::{map, shape_term};
use moat_port::term::Term;

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    return has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

fn sets() -> Vec<&'static str> {
    let mut v = vec!["scalar", "mlx"];
    if has_avx2() {
        v.push("avx2");
    }
    if has_avx512() {
        v.push("avx512");
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx512vnni") {
            // "avx512" is then the VNNI kernel for 4 and 8 bits; this is
            // the f32 one.
            v.push("avx512-novnni");
        }
    }
    v
}

/// A worker with kernel set `set` (of sets()).
fn start(set: &str) -> Worker {
    if set == "avx512-novnni" {
        Worker::start_env(&[], &[("MOAT_CPU_FEATURES", "avx512"), ("MOAT_QMM_VNNI", "0")])
    } else {
        Worker::start_env(&[], &[("MOAT_CPU_FEATURES", set)])
    }
}

/// A worker for each kernel set, forced by MOAT_CPU_FEATURES. On a GPU the
/// sets are the CPU's and change nothing (MLX's CUDA kernels compute every
/// product there, each compiled by NVRTC on first use, seconds apiece), so
/// there one worker runs the products once.
fn workers() -> Vec<(&'static str, Worker)> {
    let mut out = Vec::new();
    for set in sets() {
        let w = start(set);
        let gpu = w.on_gpu();
        out.push((set, w));
        if gpu {
            break;
        }
    }
    out
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn quant_attrs(shape: &[i32], dense: (&str, u32), bits: i64, group: i64, mode: &str) -> Vec<(&'static str, Term)> {
    vec![
        ("shape", shape_term(shape)),
        ("dense", ty(dense.0, dense.1)),
        ("bits", Term::int(bits)),
        ("group_size", Term::int(group)),
        ("mode", Term::atom(mode)),
    ]
}

fn packed_bytes(rows: usize, k: usize, bits: usize, group: usize, scale_bytes: usize, affine: bool) -> usize {
    rows * (k * bits / 8 + (k / group) * scale_bytes * if affine { 2 } else { 1 })
}

/// `x` {m, k} (id 2) times the packed weight (id 1) of `shape`, by
/// quantized_matmul (id 10) and by dequantize (11) then dot (12).
fn product_and_reference(
    w: &mut Worker,
    x_shape: &[i32],
    shape: &[i32],
    bits: i64,
    group: i64,
) -> (Vec<f32>, Vec<f32>) {
    product_and_reference_with(w, x_shape, shape, bits, group, vec![])
}

/// As product_and_reference, with more attrs (`scale_type`) for both ops.
fn product_and_reference_with(
    w: &mut Worker,
    x_shape: &[i32],
    shape: &[i32],
    bits: i64,
    group: i64,
    extra: Vec<(&'static str, Term)>,
) -> (Vec<f32>, Vec<f32>) {
    let mut q = quant_attrs(shape, ("f", 32), bits, group, "affine");
    q.extend(extra);
    q.push(("type", ty("f", 32)));
    let mut qmm = q.clone();
    qmm.push(("transpose", Term::atom("true")));
    w.request(0, "quantized_matmul", &[10], &[2, 1], map(qmm));
    w.request(0, "dequantize", &[11], &[1], map(q));
    let last = x_shape.len() as i64 - 1;
    let dot = map(vec![
        ("contract_a", ints(&[last])),
        ("batch_a", ints(&[])),
        ("contract_b", ints(&[1])),
        ("batch_b", ints(&[])),
        ("type", ty("f", 32)),
    ]);
    w.request(0, "dot", &[12], &[2, 11], dot);
    let got = w.read_f32(1, 10);
    let want = w.read_f32(2, 12);
    for id in [10, 11, 12] {
        w.request(0, "release", &[], &[id], nil());
    }
    (got, want)
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (g, e)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - e).abs() <= 1e-5 * scale,
            "{what}: element {i}: {g} vs {e} (scale {scale})"
        );
    }
}

#[test]
fn the_product_matches_dequantize_then_multiply_for_every_width_and_set() {
    let (n, k) = (70, 256);
    for (set, mut w) in workers() {
        w.upload_f32(3, &[n, k], &values((n * k) as usize, 1));
        for m in [1, 2, 3, 5, 9] {
            w.upload_f32(2, &[m, k], &values((m * k) as usize, 2 + m as u64));
            for bits in [2, 3, 4, 6, 8] {
                for group in [32, 64, 128] {
                    let attrs = map(vec![
                        ("bits", Term::int(bits)),
                        ("group_size", Term::int(group)),
                        ("mode", Term::atom("affine")),
                    ]);
                    w.request(0, "quantize", &[1], &[3], attrs);
                    let (meta, packed) = w.read(3, 1).expect("quantize");
                    assert_eq!(
                        packed.len(),
                        packed_bytes(n as usize, k as usize, bits as usize, group as usize, 4, true),
                        "{meta}"
                    );
                    let (got, want) = product_and_reference(&mut w, &[m, k], &[n, k], bits, group);
                    assert_close(&got, &want, &format!("{set}: m {m}, {bits} bits, group {group}"));
                    w.request(0, "release", &[], &[1], nil());
                }
            }
            w.request(0, "release", &[], &[2], nil());
        }
    }
}

/// Rows of 96 values: the 4-bit AVX2 kernel takes blocks of 64 (x reordered
/// once per product), so these go through its other path. Rows of 1088: 34
/// groups of 32 or 17 of 64, past the AVX-512 kernel's blocks of 16 scales.
#[test]
fn rows_that_are_not_a_multiple_of_64_values_or_of_16_groups() {
    for (n, k, group) in [(9, 96, 32), (5, 1088, 32), (5, 1088, 64)] {
        for (set, mut w) in workers() {
            w.upload_f32(3, &[n, k], &values((n * k) as usize, 11));
            for m in [1, 2, 5] {
                w.upload_f32(2, &[m, k], &values((m * k) as usize, 12 + m as u64));
                for bits in [2, 3, 4, 6, 8] {
                    let attrs = map(vec![
                        ("bits", Term::int(bits)),
                        ("group_size", Term::int(group)),
                        ("mode", Term::atom("affine")),
                    ]);
                    w.request(0, "quantize", &[1], &[3], attrs);
                    w.read(3, 1).expect("quantize");
                    let (got, want) = product_and_reference(&mut w, &[m, k], &[n, k], bits, group);
                    assert_close(&got, &want, &format!("{set}: m {m}, {bits} bits, k {k}, group {group}"));
                    w.request(0, "release", &[], &[1], nil());
                }
                w.request(0, "release", &[], &[2], nil());
            }
        }
    }
}

/// x blocks the VNNI kernel cannot split exactly (a non-finite value, all
/// values below 1e-30) send the product to the f32 kernel; blocks of very
/// different sizes are each split on their own.
#[test]
fn x_with_non_finite_tiny_and_mixed_magnitude_blocks() {
    let (n, k) = (8, 256);
    let base = values(k as usize, 21);
    let scaled = |f: &dyn Fn(usize) -> f32| -> Vec<f32> { base.iter().enumerate().map(|(i, v)| v * f(i)).collect() };
    let cases: Vec<(&str, Vec<f32>)> = vec![
        (
            "mixed magnitudes",
            scaled(&|i| if i / 64 % 2 == 0 { 1.0e6 } else { 1.0e-3 }),
        ),
        ("one tiny block", scaled(&|i| if i < 64 { 1.0e-32 } else { 1.0 })),
        (
            "zero block",
            scaled(&|i| if (128..192).contains(&i) { 0.0 } else { 1.0 }),
        ),
        ("outlier", scaled(&|i| if i == 77 { 3.0e4 } else { 1.0 })),
    ];
    for (set, mut w) in workers() {
        w.upload_f32(3, &[n, k], &values((n * k) as usize, 22));
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                let attrs = map(vec![
                    ("bits", Term::int(bits)),
                    ("group_size", Term::int(group)),
                    ("mode", Term::atom("affine")),
                ]);
                w.request(0, "quantize", &[1], &[3], attrs);
                w.read(3, 1).expect("quantize");
                for (what, x) in &cases {
                    w.upload_f32(2, &[1, k], x);
                    let (got, want) = product_and_reference(&mut w, &[1, k], &[n, k], bits, group);
                    assert_close(&got, &want, &format!("{set}: {what}, {bits} bits, group {group}"));
                    w.request(0, "release", &[], &[2], nil());
                }
                // An infinity or a NaN in x: no finite number where
                // dequantize-then-multiply gives none (an infinity times a
                // zero code may be a NaN here and an infinity there).
                for bad in [f32::INFINITY, f32::NAN] {
                    let mut x = base.clone();
                    x[100] = bad;
                    w.upload_f32(2, &[1, k], &x);
                    let (got, want) = product_and_reference(&mut w, &[1, k], &[n, k], bits, group);
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            !g.is_finite() && !e.is_finite(),
                            "{set}: x[100] = {bad}, {bits} bits, group {group}: element {i}: {g} vs {e}"
                        );
                    }
                    w.request(0, "release", &[], &[2], nil());
                }
                w.request(0, "release", &[], &[1], nil());
            }
        }
    }
}

#[test]
fn batched_strided_broadcast_and_empty_inputs() {
    let (n, k) = (16, 64);
    for (set, mut w) in workers() {
        w.upload_f32(3, &[n, k], &values((n * k) as usize, 7));
        let attrs = map(vec![
            ("bits", Term::int(4)),
            ("group_size", Term::int(32)),
            ("mode", Term::atom("affine")),
        ]);
        w.request(0, "quantize", &[1], &[3], attrs);
        // A batch {2, 3, k}.
        w.upload_f32(2, &[2, 3, k], &values((6 * k) as usize, 8));
        let (got, want) = product_and_reference(&mut w, &[2, 3, k], &[n, k], 4, 32);
        assert_close(&got, &want, &format!("{set}: batched"));
        w.request(0, "release", &[], &[2], nil());
        // A transposed view {3, k} of a {k, 3} tensor.
        w.upload_f32(4, &[k, 3], &values((3 * k) as usize, 9));
        w.request(0, "transpose", &[2], &[4], map(vec![("axes", ints(&[1, 0]))]));
        let (got, want) = product_and_reference(&mut w, &[3, k], &[n, k], 4, 32);
        assert_close(&got, &want, &format!("{set}: strided"));
        w.request(0, "release", &[], &[2], nil());
        // A row broadcast to {4, k}.
        w.upload_f32(5, &[1, k], &values(k as usize, 10));
        let b = map(vec![("shape", shape_term(&[4, k])), ("axes", ints(&[0, 1]))]);
        w.request(0, "broadcast", &[2], &[5], b);
        let (got, want) = product_and_reference(&mut w, &[4, k], &[n, k], 4, 32);
        assert_close(&got, &want, &format!("{set}: broadcast"));
        w.request(0, "release", &[], &[2], nil());
        // No rows.
        w.upload_f32(2, &[0, k], &[]);
        let (got, want) = product_and_reference(&mut w, &[0, k], &[n, k], 4, 32);
        assert!(got.is_empty() && want.is_empty(), "{set}: empty");
    }
}

#[test]
fn half_width_weights_keep_their_scales_and_compute_in_f32() {
    let (n, k) = (12, 128);
    for (set, mut w) in workers() {
        w.upload_f32(4, &[n, k], &values((n * k) as usize, 11));
        w.upload_f32(2, &[2, k], &values((2 * k) as usize, 12));
        for (kind, bits) in [("f", 16), ("bf", 16)] {
            w.request(0, "astype", &[3], &[4], typed(kind, bits));
            let attrs = map(vec![
                ("bits", Term::int(8)),
                ("group_size", Term::int(64)),
                ("mode", Term::atom("affine")),
            ]);
            w.request(0, "quantize", &[1], &[3], attrs);
            let (_, packed) = w.read(3, 1).expect("quantize");
            assert_eq!(packed.len(), packed_bytes(n as usize, k as usize, 8, 64, 2, true));
            let mut q = quant_attrs(&[n, k], (kind, bits), 8, 64, "affine");
            q.push(("type", ty("f", 32)));
            let mut qmm = q.clone();
            qmm.push(("transpose", Term::atom("true")));
            w.request(0, "quantized_matmul", &[10], &[2, 1], map(qmm));
            w.request(0, "dequantize", &[11], &[1], map(q));
            let dot = map(vec![
                ("contract_a", ints(&[1])),
                ("batch_a", ints(&[])),
                ("contract_b", ints(&[1])),
                ("batch_b", ints(&[])),
                ("type", ty("f", 32)),
            ]);
            w.request(0, "dot", &[12], &[2, 11], dot);
            let got = w.read_f32(4, 10);
            let want = w.read_f32(5, 12);
            assert_close(&got, &want, &format!("{set}: {kind}{bits} scales"));
            for id in [1, 3, 10, 11, 12] {
                w.request(0, "release", &[], &[id], nil());
            }
        }
    }
}

/// The format #18 asks for (at most 4.5 bits a 4-bit weight): an f32 weight
/// with bf16 scales and biases, read by every kernel set as they are.
#[test]
fn f32_weights_with_bf16_scales_hold_fewer_bytes_and_multiply_alike() {
    let (n, k) = (20, 512);
    for set in sets() {
        let mut w = start(set);
        w.upload_f32(3, &[n, k], &values((n * k) as usize, 21));
        for m in [1, 3] {
            w.upload_f32(2, &[m, k], &values((m * k) as usize, 22 + m as u64));
            for bits in [2, 3, 4, 6, 8] {
                for group in [32, 64, 128] {
                    let attrs = map(vec![
                        ("bits", Term::int(bits)),
                        ("group_size", Term::int(group)),
                        ("mode", Term::atom("affine")),
                        ("scale_type", ty("bf", 16)),
                    ]);
                    w.request(0, "quantize", &[1], &[3], attrs);
                    let (_, packed) = w.read(3, 1).expect("quantize");
                    let bytes = packed_bytes(n as usize, k as usize, bits as usize, group as usize, 2, true);
                    assert_eq!(packed.len(), bytes, "{set}: {bits} bits, group {group}");
                    let extra = vec![("scale_type", ty("bf", 16))];
                    let (got, want) = product_and_reference_with(&mut w, &[m, k], &[n, k], bits, group, extra);
                    assert_close(
                        &got,
                        &want,
                        &format!("{set}: bf16 scales, m {m}, {bits} bits, group {group}"),
                    );
                    w.request(0, "release", &[], &[1], nil());
                }
            }
            w.request(0, "release", &[], &[2], nil());
        }
        // f16 cannot hold every f32 scale: refused for an f32 weight.
        let attrs = map(vec![
            ("bits", Term::int(4)),
            ("group_size", Term::int(64)),
            ("mode", Term::atom("affine")),
            ("scale_type", ty("f", 16)),
        ]);
        w.request(0, "quantize", &[1], &[3], attrs);
        let (op, message) = error_parts(&w.read(4, 1).unwrap_err());
        assert_eq!(op, "quantize");
        assert!(
            message.contains("scales of a f32 weight are f32, bf16 or its own type"),
            "{message}"
        );
    }
}

#[test]
fn microscaled_modes_round_trip_and_multiply() {
    let mut w = Worker::start(&[]);
    let (n, k) = (8, 64);
    w.upload_f32(3, &[n, k], &values((n * k) as usize, 13));
    w.upload_f32(2, &[1, k], &values(k as usize, 14));
    for (mode, bits, group) in [("mxfp4", 4, 32), ("mxfp8", 8, 32), ("nvfp4", 4, 16)] {
        let attrs = map(vec![
            ("bits", Term::int(bits)),
            ("group_size", Term::int(group)),
            ("mode", Term::atom(mode)),
        ]);
        w.request(0, "quantize", &[1], &[3], attrs);
        let (_, packed) = w.read(1, 1).expect("quantize");
        assert_eq!(
            packed.len(),
            packed_bytes(n as usize, k as usize, bits as usize, group as usize, 1, false)
        );
        let mut q = quant_attrs(&[n, k], ("f", 32), bits, group, mode);
        q.push(("type", ty("f", 32)));
        w.request(0, "dequantize", &[11], &[1], map(q.clone()));
        let dense = w.read_f32(2, 11);
        let orig = values((n * k) as usize, 13);
        let worst = dense.iter().zip(&orig).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < 0.5, "{mode}: dequantized values off by {worst}");
        q.push(("transpose", Term::atom("true")));
        w.request(0, "quantized_matmul", &[10], &[2, 1], map(q));
        assert_eq!(w.read_f32(3, 10).len(), n as usize, "{mode}");
        for id in [1, 10, 11] {
            w.request(0, "release", &[], &[id], nil());
        }
    }
}

#[test]
fn descriptions_that_do_not_match_the_packed_bytes_fail_the_op() {
    let mut w = Worker::start(&[]);
    w.upload_f32(3, &[4, 64], &values(256, 15));
    let attrs = map(vec![
        ("bits", Term::int(4)),
        ("group_size", Term::int(64)),
        ("mode", Term::atom("affine")),
    ]);
    w.request(0, "quantize", &[1], &[3], attrs);
    // Another shape than the packed weight's.
    let mut q = quant_attrs(&[8, 64], ("f", 32), 4, 64, "affine");
    q.push(("type", ty("f", 32)));
    w.request(0, "dequantize", &[2], &[1], map(q));
    let (op, message) = error_parts(&w.read(1, 2).unwrap_err());
    assert_eq!(op, "dequantize");
    assert!(
        message.contains("does not hold a 4-bit affine weight of shape {8, 64}"),
        "{message}"
    );
    // A weight whose last axis is not a multiple of the group.
    w.upload_f32(4, &[4, 48], &values(192, 16));
    let attrs = map(vec![
        ("bits", Term::int(4)),
        ("group_size", Term::int(64)),
        ("mode", Term::atom("affine")),
    ]);
    w.request(0, "quantize", &[5], &[4], attrs);
    let (op, message) = error_parts(&w.read(2, 5).unwrap_err());
    assert_eq!(op, "quantize");
    assert!(message.contains("multiple of the group size 64"), "{message}");
    // x that does not contract with the weight.
    w.upload_f32(6, &[1, 32], &values(32, 17));
    let mut q = quant_attrs(&[4, 64], ("f", 32), 4, 64, "affine");
    q.push(("transpose", Term::atom("true")));
    w.request(0, "quantized_matmul", &[7], &[6, 1], map(q));
    let (op, message) = error_parts(&w.read(3, 7).unwrap_err());
    assert_eq!(op, "quantized_matmul");
    assert!(message.contains("does not contract"), "{message}");
    // An integer weight.
    w.upload(8, &[2, 64], "s", 32, &i32_bytes(&[1; 128]));
    let attrs = map(vec![
        ("bits", Term::int(4)),
        ("group_size", Term::int(64)),
        ("mode", Term::atom("affine")),
    ]);
    w.request(0, "quantize", &[9], &[8], attrs);
    let (_, message) = error_parts(&w.read(4, 9).unwrap_err());
    assert!(message.contains("f32, f16 or bf16"), "{message}");
}
