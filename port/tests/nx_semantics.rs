//! Graph ops whose Nx semantics live in the worker, checked through real
//! frames: conversions of non-finite floats, rounding, padding, scans.

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;

#[test]
fn as_type_maps_non_finite_floats_like_nx() {
    let mut w = Worker::start(&[]);
    let values = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 2.9, -2.9, 300.0, -1.0];
    w.upload_f32(1, &[7], &values);
    w.request(0, "astype", &[2], &[1], map(vec![("type", ty("s", 32))]));
    w.request(0, "astype", &[3], &[1], map(vec![("type", ty("u", 8))]));
    w.request(0, "astype", &[4], &[1], map(vec![("type", ty("u", 64))]));
    assert_eq!(i32_values(&w.read_bytes(1, 2)), [0, i32::MAX, i32::MIN, 2, -2, 300, -1]);
    // Finite values wrap like Nx (300 -> 44, -1 -> 255); infinities saturate.
    assert_eq!(w.read_bytes(2, 3), [0, 255, 0, 2, 254, 44, 255]);
    let u64s: Vec<u64> = w
        .read_bytes(3, 4)
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(u64s, [0, u64::MAX, 0, 2, u64::MAX - 1, 300, u64::MAX]);
}

#[test]
fn round_goes_half_away_from_zero() {
    let mut w = Worker::start(&[]);
    let values = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -0.49999997, 1e30];
    w.upload_f32(1, &[9], &values);
    w.request(0, "round", &[2], &[1], typed("f", 32));
    assert_eq!(w.read_f32(1, 2), [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 0.0, -0.0, 1e30]);
}

#[test]
fn pad_takes_interior_and_negative_padding() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[3], &[1.0, 2.0, 3.0]);
    w.upload_f32(2, &[], &[0.0]);
    let pad = |config: &[i64]| map(vec![("config", Term::List(vec![ints(config)])), ("type", ty("f", 32))]);
    // Two zeros between elements, one before, one cut from the end.
    w.request(0, "pad", &[3], &[1, 2], pad(&[1, -1, 2]));
    assert_eq!(w.read_f32(1, 3), [0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0]);
    // Cutting into the data itself.
    w.request(0, "pad", &[4], &[1, 2], pad(&[-2, 1, 1]));
    assert_eq!(w.read_f32(2, 4), [2.0, 0.0, 3.0, 0.0]);
}

#[test]
fn cumulative_ops_scan_interior_axes_in_both_directions() {
    let mut w = Worker::start(&[]);
    let values: Vec<f32> = (1..=12).map(|i| i as f32).collect();
    w.upload_f32(1, &[2, 3, 2], &values);
    let scan = |reverse: bool| {
        map(vec![
            ("axis", Term::int(1)),
            ("reverse", Term::atom(if reverse { "true" } else { "false" })),
            ("type", ty("f", 32)),
        ])
    };
    w.request(0, "cumulative_sum", &[2], &[1], scan(false));
    w.request(0, "cumulative_sum", &[3], &[1], scan(true));
    assert_eq!(
        w.read_f32(1, 2),
        [1.0, 2.0, 4.0, 6.0, 9.0, 12.0, 7.0, 8.0, 16.0, 18.0, 27.0, 30.0]
    );
    assert_eq!(
        w.read_f32(2, 3),
        [9.0, 12.0, 8.0, 10.0, 5.0, 6.0, 27.0, 30.0, 20.0, 22.0, 11.0, 12.0]
    );
}

#[test]
fn half_precision_cummax_keeps_nan() {
    let mut w = Worker::start(&[]);
    // f16: 1.0, NaN, 3.0
    let bytes: Vec<u8> = [0x3c00u16, 0x7e00, 0x4200]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect();
    w.upload(1, &[3], "f", 16, &bytes);
    let attrs = map(vec![
        ("axis", Term::int(0)),
        ("reverse", Term::atom("false")),
        ("type", ty("f", 16)),
    ]);
    w.request(0, "cumulative_max", &[2], &[1], attrs);
    let out: Vec<u16> = w
        .read_bytes(1, 2)
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert_eq!(out[0], 0x3c00);
    assert!(
        out[1..].iter().all(|h| h & 0x7c00 == 0x7c00 && h & 0x03ff != 0),
        "NaN expected, got {out:x?}"
    );
}

#[test]
fn half_precision_cumsum_accumulates_in_f32() {
    let mut w = Worker::start(&[]);
    // 3000 ones in f16: a running f16 sum would stop at 2048.
    let bytes: Vec<u8> = std::iter::repeat_n(0x3c00u16.to_le_bytes(), 3000).flatten().collect();
    w.upload(1, &[3000], "f", 16, &bytes);
    let attrs = map(vec![
        ("axis", Term::int(0)),
        ("reverse", Term::atom("false")),
        ("type", ty("f", 16)),
    ]);
    w.request(0, "cumulative_sum", &[2], &[1], attrs);
    let out = w.read_bytes(1, 2);
    // 3000 is exact in f16 (spacing 2 above 2048).
    assert_eq!(u16::from_le_bytes([out[2 * 2999], out[2 * 2999 + 1]]), 0x69dc);
}

#[test]
fn shifts_past_the_width_shift_everything_out() {
    let mut w = Worker::start(&[]);
    let x: Vec<u8> = [1i32, -8, -8, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
    let by: Vec<u8> = [33i32, 40, 1, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
    w.upload(1, &[4], "s", 32, &x);
    w.upload(2, &[4], "s", 32, &by);
    w.request(0, "left_shift", &[3], &[1, 2], typed("s", 32));
    w.request(0, "right_shift", &[4], &[1, 2], typed("s", 32));
    assert_eq!(i32_values(&w.read_bytes(1, 3)), [0, 0, -16, 0]);
    assert_eq!(i32_values(&w.read_bytes(2, 4)), [0, -1, -4, 0]);
}

#[test]
fn argmax_prefers_the_last_nan_and_honours_tie_break() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[5], &[1.0, 3.0, f32::NAN, 3.0, f32::NAN]);
    w.upload_f32(2, &[4], &[1.0, 3.0, 2.0, 3.0]);
    let arg = |tie: &str| {
        map(vec![
            ("axis", Term::int(0)),
            ("keep_axes", Term::atom("false")),
            ("tie_break", Term::atom(tie)),
            ("type", ty("s", 32)),
        ])
    };
    w.request(0, "argmax", &[3], &[1], arg("low"));
    w.request(0, "argmax", &[4], &[2], arg("low"));
    w.request(0, "argmax", &[5], &[2], arg("high"));
    assert_eq!(i32_values(&w.read_bytes(1, 3)), [4]);
    assert_eq!(i32_values(&w.read_bytes(2, 4)), [1]);
    assert_eq!(i32_values(&w.read_bytes(3, 5)), [3]);
}

#[test]
fn bad_attributes_name_the_op() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.request(
        0,
        "sort",
        &[2],
        &[1],
        map(vec![("axis", Term::int(0)), ("direction", Term::atom("sideways"))]),
    );
    let (op, message) = error_parts(&w.read(1, 2).unwrap_err());
    assert_eq!(op, "sort");
    assert!(message.contains("direction must be :asc or :desc"), "{message}");
    w.request(0, "transpose", &[3], &[1], map(vec![("axes", ints(&[0, 1]))]));
    let (op, _) = error_parts(&w.read(2, 3).unwrap_err());
    assert_eq!(op, "transpose");
}

#[test]
fn nil_boolean_attributes_read_as_false() {
    // Nx passes `equal_nan: nil` (its own test helpers do), and Elixir reads
    // nil as false.
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, f32::NAN]);
    let close = |equal_nan: Term| {
        map(vec![
            ("input_type", ty("f", 32)),
            ("rtol", Term::Float(1e-5)),
            ("atol", Term::Float(1e-8)),
            ("equal_nan", equal_nan),
            ("type", ty("u", 8)),
        ])
    };
    w.request(0, "all_close", &[2], &[1, 1], close(nil()));
    w.request(0, "all_close", &[3], &[1, 1], close(Term::atom("true")));
    assert_eq!(w.read_bytes(1, 2), [0]);
    assert_eq!(w.read_bytes(2, 3), [1]);
    w.request(0, "all_close", &[4], &[1, 1], close(Term::int(1)));
    let (op, message) = error_parts(&w.read(3, 4).unwrap_err());
    assert_eq!(op, "all_close");
    assert!(message.contains("expected a boolean, got 1"), "{message}");
}
