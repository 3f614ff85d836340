//! Worker-side guards against inputs that crash MLX 0.32.4 on the CPU:
//! out-of-range indices, `MIN / -1`, element counts that overflow. Each must
//! fail the op (or give Nx's result) with the worker still serving.

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
