//! The `fast_*` ops (Moat.Fast) through real frames: values on small inputs,
//! and shapes MLX would refuse named with the op and the cause.

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;

fn f32_type() -> (&'static str, Term) {
    ("type", ty("f", 32))
}

#[test]
fn rms_norm_and_layer_norm_of_a_row() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[1, 4], &[1.0, -1.0, 1.0, -1.0]);
    w.upload_f32(2, &[4], &[1.0, 2.0, 3.0, 4.0]);
    w.upload_f32(3, &[4], &[0.5; 4]);
    let attrs = || map(vec![("eps", Term::Float(0.0)), f32_type()]);
    w.request(0, "fast_rms_norm", &[4], &[1, 2], attrs());
    assert_eq!(w.read_f32(1, 4), [1.0, -2.0, 3.0, -4.0]);
    w.request(0, "fast_layer_norm", &[5], &[1, 2, 3], attrs());
    assert_eq!(w.read_f32(2, 5), [1.5, -1.5, 3.5, -3.5]);
}

#[test]
fn rope_turns_each_row_of_seq_axis_by_its_position() {
    let mut w = Worker::start(&[]);
    // {T: 2, H: 2, D: 2} with positions along axis 0: both heads of row t
    // turn [1, 0] by angle offset + t.
    w.upload_f32(1, &[1, 2, 2, 2], &[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
    let attrs = map(vec![
        ("dims", Term::int(2)),
        ("traditional", Term::atom("false")),
        ("base", Term::Float(1.0)),
        ("scale", Term::Float(1.0)),
        ("offset", Term::int(3)),
        ("seq_axis", Term::int(1)),
        f32_type(),
    ]);
    w.request(0, "fast_rope", &[2], &[1], attrs);
    let got = w.read_f32(1, 2);
    let (c3, s3, c4, s4) = (3f32.cos(), 3f32.sin(), 4f32.cos(), 4f32.sin());
    for (g, e) in got.iter().zip([c3, s3, c3, s3, c4, s4, c4, s4]) {
        assert!((g - e).abs() < 1e-6, "{got:?}");
    }
}

#[test]
fn sdpa_with_grouped_heads_and_a_causal_mask() {
    let mut w = Worker::start(&[]);
    // Two query heads share one kv head; the first query sees only key 0.
    w.upload_f32(1, &[1, 2, 2, 1], &[1.0, 1.0, 1.0, 1.0]);
    w.upload_f32(2, &[1, 1, 2, 1], &[0.0, 0.0]);
    w.upload_f32(3, &[1, 1, 2, 1], &[2.0, 4.0]);
    let attrs = map(vec![
        ("scale", Term::Float(1.0)),
        ("causal", Term::atom("true")),
        f32_type(),
    ]);
    w.request(0, "fast_sdpa", &[4], &[1, 2, 3], attrs);
    assert_eq!(w.read_f32(1, 4), [2.0, 3.0, 2.0, 3.0]);
}

#[test]
fn bad_shapes_name_the_op_and_the_worker_carries_on() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2, 4], &[1.0; 8]);
    w.upload_f32(2, &[3], &[1.0; 3]);
    w.request(
        0,
        "fast_rms_norm",
        &[3],
        &[1, 2],
        map(vec![("eps", Term::Float(1e-5)), f32_type()]),
    );
    let (op, message) = error_parts(&w.read(1, 3).unwrap_err());
    assert_eq!(op, "fast_rms_norm");
    assert!(message.contains("weight must have shape [4]"), "{message}");

    let rope = |dims: i64, seq_axis: i64| {
        map(vec![
            ("dims", Term::int(dims)),
            ("traditional", Term::atom("true")),
            ("base", Term::Float(10000.0)),
            ("scale", Term::Float(1.0)),
            ("offset", Term::int(0)),
            ("seq_axis", Term::int(seq_axis)),
            f32_type(),
        ])
    };
    w.request(0, "fast_rope", &[4], &[1], rope(3, 0));
    let (_, message) = error_parts(&w.read(2, 4).unwrap_err());
    assert!(message.contains("dims must be even"), "{message}");
    w.request(0, "fast_rope", &[5], &[1], rope(2, 1));
    let (_, message) = error_parts(&w.read(3, 5).unwrap_err());
    assert!(message.contains("seq_axis cannot be the feature"), "{message}");

    w.upload_f32(6, &[1, 3, 2, 4], &[1.0; 24]);
    w.upload_f32(7, &[1, 2, 2, 4], &[1.0; 16]);
    let sdpa = map(vec![
        ("scale", Term::Float(1.0)),
        ("causal", Term::atom("false")),
        f32_type(),
    ]);
    w.request(0, "fast_sdpa", &[8], &[6, 7, 7], sdpa);
    let (op, message) = error_parts(&w.read(4, 8).unwrap_err());
    assert_eq!(op, "fast_sdpa");
    assert!(message.contains("not a multiple of k's 2"), "{message}");

    w.request(
        0,
        "fast_rms_norm",
        &[9],
        &[1, 1],
        map(vec![("eps", Term::Float(1e-5)), ("type", ty("s", 32))]),
    );
    let (_, message) = error_parts(&w.read(5, 9).unwrap_err());
    assert!(message.contains("expected a real float type"), "{message}");

    w.upload_f32(11, &[4], &[1.0; 4]);
    w.request(
        0,
        "fast_rms_norm",
        &[10],
        &[1, 11],
        map(vec![("eps", Term::Float(0.0)), f32_type()]),
    );
    assert_eq!(w.read_f32(6, 10), [1.0; 8]);
}
