//! Worker-side guards against inputs that crash MLX 0.32.4 on the CPU, or
//! the worker itself: out-of-range indices, `MIN / -1`, element counts that
//! overflow, index and divisor checks beyond the memory limit, bad axes,
//! zero strides and group sizes. Each must fail the op (or give Nx's result)
//! with the worker still serving.

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;
use std::time::Duration;

fn upload_s32(w: &mut Worker, id: u64, shape: &[i32], values: &[i32]) {
    w.upload(id, shape, "s", 32, &i32_bytes(values));
}

fn read_s32(w: &mut Worker, seq: u64, id: u64) -> Vec<i32> {
    i32_values(&w.read_bytes(seq, id))
}

/// The worker answers the next call: it is alive and its tensors are intact.
fn assert_serving(w: &mut Worker, seq: u64, survivor: u64) {
    assert_eq!(w.read_f32(seq, survivor), vec![1.0, 2.0]);
}

#[test]
fn out_of_range_indices_fail_the_op_and_the_worker_keeps_serving() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.upload_f32(2, &[3, 4], &[0.0; 12]);
    // Far out of range (MLX: SIGSEGV), just out of range (garbage), negative.
    for (k, index) in [1_000_000_000, 3, -1].into_iter().enumerate() {
        let (idx, out) = (10 + 2 * k as u64, 11 + 2 * k as u64);
        upload_s32(&mut w, idx, &[2], &[0, index]);
        w.request(0, "take", &[out], &[2, idx], map(vec![("axis", Term::int(0))]));
        let (op, message) = error_parts(&w.read(k as u64 + 1, out).unwrap_err());
        assert_eq!(op, "take");
        assert!(
            message.contains(&format!("index {index} is out of bounds for axis 0")),
            "{message}"
        );
    }
    upload_s32(&mut w, 20, &[1, 2], &[2, 4]);
    w.request(0, "gather", &[21], &[2, 20], map(vec![("axes", ints(&[0, 1]))]));
    let (op, message) = error_parts(&w.read(5, 21).unwrap_err());
    assert_eq!(
        (op.as_str(), message.contains("index 4 is out of bounds for axis 1")),
        ("gather", true),
        "{message}"
    );
    upload_s32(&mut w, 22, &[1, 2], &[7, 0]);
    w.upload_f32(23, &[1], &[5.0]);
    let scatter = map(vec![("axes", ints(&[0, 1])), ("type", ty("f", 32))]);
    w.request(0, "indexed_put", &[24], &[2, 22, 23], scatter);
    let (op, message) = error_parts(&w.read(6, 24).unwrap_err());
    assert_eq!(
        (op.as_str(), message.contains("index 7 is out of bounds for axis 0")),
        ("indexed_put", true),
        "{message}"
    );
    assert_serving(&mut w, 7, 1);
    w.close(Duration::from_secs(1));
}

#[test]
fn indexed_put_keeps_the_last_update_of_each_index() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[4], &[0.0; 4]);
    let n = 64;
    let indices: Vec<i32> = (0..n).map(|i| i % 2).collect();
    upload_s32(&mut w, 2, &[n, 1], &indices);
    let updates: Vec<f32> = (0..n).map(|i| i as f32).collect();
    w.upload_f32(3, &[n], &updates);
    let attrs = map(vec![("axes", ints(&[0])), ("type", ty("f", 32))]);
    w.request(0, "indexed_put", &[4], &[1, 2, 3], attrs);
    assert_eq!(w.read_f32(1, 4), vec![62.0, 63.0, 0.0, 0.0]);
    w.close(Duration::from_secs(1));
}

#[test]
fn min_divided_by_minus_one_wraps_as_nx_does() {
    let mut w = Worker::start(&[]);
    upload_s32(&mut w, 1, &[3], &[i32::MIN, i32::MIN, -7]);
    upload_s32(&mut w, 2, &[3], &[-1, 2, 2]);
    w.request(0, "quotient", &[3], &[1, 2], typed("s", 32));
    w.request(0, "remainder", &[4], &[1, 2], typed("s", 32));
    assert_eq!(read_s32(&mut w, 1, 3), vec![i32::MIN, i32::MIN / 2, -3]);
    assert_eq!(read_s32(&mut w, 2, 4), vec![0, 0, -1]);
    upload_s32(&mut w, 5, &[3], &[1, 0, 1]);
    w.request(0, "quotient", &[6], &[1, 5], typed("s", 32));
    let (op, message) = error_parts(&w.read(3, 6).unwrap_err());
    assert_eq!((op.as_str(), message.as_str()), ("quotient", "division by zero"));
    w.close(Duration::from_secs(1));
}

#[test]
fn outputs_whose_element_count_overflows_fail_the_op() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.upload_f32(2, &[], &[1.0]);
    // 2^64 elements: MLX's count wraps to 0.
    let shape = moat_port::protocol::shape_term(&[65_536, 65_536, 65_536, 65_536]);
    w.request(0, "broadcast_to", &[3], &[2], map(vec![("shape", shape)]));
    let (op, message) = error_parts(&w.read(1, 3).unwrap_err());
    assert_eq!(op, "broadcast_to");
    assert!(message.contains("more than any address space"), "{message}");
    assert_serving(&mut w, 2, 1);
    w.close(Duration::from_secs(1));
}

#[test]
fn detect_non_finite_fails_the_op_that_produced_nan() {
    let attrs = || typed("f", 32);
    for (flag, fails) in [("true", true), ("false", false)] {
        let mut w = Worker::start(&["--detect-non-finite", flag]);
        w.upload_f32(1, &[2], &[0.0, 1.0]);
        w.request(0, "divide", &[2], &[1, 1], attrs());
        w.request(0, "add", &[3], &[1, 1], attrs());
        match w.read(1, 2) {
            Err(e) if fails => {
                let (op, message) = error_parts(&e);
                assert_eq!(op, "divide");
                assert!(message.contains("NaN or infinity"), "{message}");
            }
            Ok((_, bytes)) if !fails => assert!(f32::from_le_bytes(bytes[..4].try_into().unwrap()).is_nan()),
            other => panic!("detect_non_finite {flag}: {other:?}"),
        }
        assert_eq!(w.read_f32(2, 3), vec![0.0, 2.0]);
        w.close(Duration::from_secs(1));
    }
}

fn memory_info(w: &mut Worker, seq: u64, key: &str) -> i128 {
    w.request(seq, "memory_info", &[], &[], nil());
    let (reply, _) = w.recv();
    let info = reply.as_tuple().unwrap()[2].clone();
    info.get(key).and_then(Term::as_int).unwrap()
}

fn set_memory_limit(w: &mut Worker, seq: u64, bytes: i64) {
    w.request(seq, "set_memory_limit", &[], &[], Term::int(bytes));
    w.recv();
}

#[test]
fn indices_too_large_for_the_memory_limit_fail_the_op_instead_of_the_worker() {
    let mut w = Worker::start(&[]);
    // A limit below the 64 GiB result wherever the worker runs (a GPU's
    // default limit, 95% of its memory, may be above it).
    set_memory_limit(&mut w, 100, 16 << 30);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.upload(2, &[], "u", 8, &[0]);
    // 2^34 u8 indices as a broadcast view (no bytes yet): once crashed the
    // worker (SIGSEGV) while converting them for a host-side check.
    let huge = map(vec![("shape", ints(&[1 << 17, 1 << 17])), ("axes", ints(&[]))]);
    w.request(0, "broadcast", &[3], &[2], huge);
    w.request(0, "take", &[4], &[1, 3], map(vec![("axis", Term::int(0))]));
    // The result, 64 GiB, is refused when it is built or when evaluated.
    let (_, message) = error_parts(&w.read(1, 4).unwrap_err());
    assert!(message.contains("memory limit exceeded"), "{message}");
    // Indices as large as the limit allows: checked within it, without a copy.
    set_memory_limit(&mut w, 2, 64 << 20);
    w.request(3, "reset_peak_memory", &[], &[], nil());
    w.recv();
    let big = map(vec![("shape", ints(&[1 << 25])), ("axes", ints(&[]))]);
    w.request(0, "broadcast", &[5], &[2], big);
    w.request(0, "take", &[6], &[1, 5], map(vec![("axis", Term::int(0))]));
    w.request(0, "take", &[7], &[1, 2], map(vec![("axis", Term::int(0))]));
    assert_eq!(w.read_f32(4, 7), vec![1.0]);
    let peak = memory_info(&mut w, 5, "peak");
    // MLX's CUDA backend copies the broadcast indices for the check (2^25 of
    // them, 64 MiB): about the limit, where the CPU's check copies none.
    let bound = if w.on_gpu() { (64 << 20) + (1 << 20) } else { 1 << 20 };
    assert!(peak < bound, "checking a broadcast index held {peak} bytes");
    assert_serving(&mut w, 6, 1);
    w.close(Duration::from_secs(1));
}

#[test]
fn the_divisor_check_evaluates_within_the_memory_limit() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    set_memory_limit(&mut w, 1, 20 << 20);
    upload_s32(&mut w, 2, &[], &[1]);
    w.request(
        0,
        "iota",
        &[3],
        &[],
        map(vec![
            ("shape", ints(&[1 << 22])),
            ("axis", nil()),
            ("type", ty("s", 32)),
        ]),
    );
    // Two lazy 16 MiB adds, each admitted alone, together past the limit.
    w.request(0, "add", &[4], &[3, 3], typed("s", 32));
    w.request(0, "add", &[5], &[4, 4], typed("s", 32));
    w.request(0, "quotient", &[6], &[2, 5], typed("s", 32));
    let (op, message) = error_parts(&w.read(2, 6).unwrap_err());
    assert_eq!(op, "quotient");
    assert!(message.contains("memory limit exceeded"), "{message}");
    assert!(memory_info(&mut w, 3, "peak") <= 20 << 20);
    assert_serving(&mut w, 4, 1);
    w.close(Duration::from_secs(1));
}

#[test]
fn gather_over_no_axes_repeats_the_tensor_per_index_tuple() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    // Tuples of no indices: 2^20 of them, in 0 bytes (once read past them).
    w.upload(2, &[1 << 20, 0], "s", 32, &[]);
    w.request(0, "gather", &[3], &[1, 2], map(vec![("axes", ints(&[]))]));
    w.request(
        0,
        "sum",
        &[4],
        &[3],
        map(vec![("axes", ints(&[0, 1])), ("keep_axes", Term::atom("false"))]),
    );
    assert_eq!(w.read_f32(1, 4), vec![3.0 * (1 << 20) as f32]);
    assert_serving(&mut w, 2, 1);
    w.close(Duration::from_secs(1));
}

#[test]
fn bad_axes_and_permutations_fail_the_op() {
    let sort = |axis| {
        map(vec![
            ("axis", Term::int(axis)),
            ("direction", Term::atom("desc")),
            ("type", ty("s", 64)),
        ])
    };
    let solve = map(vec![
        ("left_side", Term::atom("true")),
        ("lower", Term::atom("true")),
        ("transform_a", Term::atom("transpose")),
        ("type", ty("f", 32)),
    ]);
    let cases: Vec<(&str, Vec<u64>, Term, &str)> = vec![
        ("argsort", vec![1], sort(5), "axis 5 is out of range"),
        ("sort", vec![1], sort(-1), "axis -1 is out of range"),
        (
            "take",
            vec![1, 1],
            map(vec![("axis", Term::int(3))]),
            "axis 3 is out of range",
        ),
        ("triangular_solve", vec![1, 1], solve, "expected a matrix"),
        (
            "conv",
            vec![2, 2],
            conv_attrs(&[("output_permutation", ints(&[0, 1, 7]))]),
            "not a permutation",
        ),
        (
            "conv",
            vec![2, 2],
            conv_attrs(&[("input_permutation", ints(&[0, 0, 1]))]),
            "not a permutation",
        ),
    ];
    assert_each_fails(cases);
}

#[test]
fn zero_strides_and_group_sizes_fail_the_op() {
    let slice = map(vec![
        ("starts", ints(&[0])),
        ("lengths", ints(&[2])),
        ("strides", ints(&[0])),
    ]);
    let positive = "positive integer";
    let cases: Vec<(&str, Vec<u64>, Term, &str)> = vec![
        ("slice", vec![1], slice, positive),
        (
            "conv",
            vec![2, 2],
            conv_attrs(&[("feature_group_size", Term::int(0))]),
            positive,
        ),
        (
            "conv",
            vec![2, 2],
            conv_attrs(&[("batch_group_size", Term::int(0))]),
            positive,
        ),
        ("conv", vec![2, 2], conv_attrs(&[("strides", ints(&[0]))]), positive),
        (
            "conv",
            vec![2, 2],
            conv_attrs(&[("kernel_dilation", ints(&[0]))]),
            positive,
        ),
    ];
    assert_each_fails(cases);
}

/// Sends each `(op, ins, attrs, expected)` to a worker holding a vector
/// (id 1) and a [1, 1, 2] tensor (id 2): the op fails with a message that
/// holds `expected`, and the worker goes on.
fn assert_each_fails(cases: Vec<(&str, Vec<u64>, Term, &str)>) {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.upload_f32(2, &[1, 1, 2], &[1.0, 1.0]);
    for (k, (op, ins, attrs, expected)) in cases.into_iter().enumerate() {
        let out = 10 + k as u64;
        w.request(0, op, &[out], &ins, attrs);
        let (failed, message) = error_parts(&w.read(k as u64 + 1, out).unwrap_err());
        assert_eq!(failed, op);
        assert!(message.contains(expected), "{op}: {message}");
    }
    assert_serving(&mut w, 20, 1);
    w.close(Duration::from_secs(1));
}

#[test]
fn decompositions_build_without_host_memory() {
    let mut w = Worker::start(&[]);
    set_memory_limit(&mut w, 1, 100 << 20);
    w.request(2, "reset_peak_memory", &[], &[], nil());
    w.recv();
    w.upload_f32(1, &[], &[1.0]);
    let square = map(vec![("shape", ints(&[4000, 4000])), ("axes", ints(&[]))]);
    w.request(0, "broadcast", &[2], &[1], square);
    w.request(0, "cholesky", &[3], &[2], typed("f", 32));
    w.request(0, "determinant", &[4], &[2], typed("f", 32));
    w.request(3, "sync", &[], &[], nil());
    w.recv();
    let peak = memory_info(&mut w, 4, "peak");
    assert!(peak < 1 << 20, "building the ops held {peak} bytes");
    w.close(Duration::from_secs(1));
}

/// A 1-d convolution of a [1, 1, 2] input with a [1, 1, 2] kernel, with some
/// attrs replaced.
fn conv_attrs(replace: &[(&str, Term)]) -> Term {
    let mut attrs = vec![
        ("strides", ints(&[1])),
        (
            "padding",
            Term::List(vec![Term::tuple(vec![Term::int(0), Term::int(0)])]),
        ),
        ("input_dilation", ints(&[1])),
        ("kernel_dilation", ints(&[1])),
        ("feature_group_size", Term::int(1)),
        ("batch_group_size", Term::int(1)),
        ("input_permutation", ints(&[0, 1, 2])),
        ("kernel_permutation", ints(&[0, 1, 2])),
        ("output_permutation", ints(&[0, 1, 2])),
        ("type", ty("f", 32)),
    ];
    for (key, value) in replace {
        attrs.iter_mut().find(|(k, _)| k == key).expect("a conv attr").1 = value.clone();
    }
    map(attrs)
}
