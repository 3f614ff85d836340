//! Failures as data (protocol.md §4): every kind a real worker reports, with
//! its fields and its message, which never starts with the op's name.

mod common;

use common::{error_kind, error_parts, ids, nil, request, ty, Worker};
use moat_port::protocol::map;
use moat_port::term::Term;

fn failure_of(reply: &Term) -> &Term {
    &reply.as_tuple().expect("a reply tuple")[3]
}

#[test]
fn an_invalid_request_is_of_kind_invalid() {
    let mut w = Worker::start(&[]);
    w.request(1, "frobnicate", &[], &[], nil());
    let (reply, _) = w.recv();
    assert_eq!(error_kind(&reply), "invalid");
    assert_eq!(
        error_parts(&reply),
        ("frobnicate".into(), "unknown op frobnicate".into())
    );
}

#[test]
fn an_upload_over_the_limit_is_of_kind_memory_limit_with_the_sizes() {
    let mut w = Worker::start(&[]);
    w.request(1, "set_memory_limit", &[], &[], Term::int(4 << 20));
    w.recv();
    // 8 MiB, fire-and-forget: the failure is reported unprompted, poisons
    // the id, and the read says so again.
    w.upload(5, &[2 << 20], "f", 32, &vec![0; 8 << 20]);
    let (unprompted, _) = w.recv();
    let reply = w.read(2, 5).unwrap_err();
    assert_eq!(failure_of(&unprompted), failure_of(&reply));
    assert_eq!(error_kind(&reply), "memory_limit");
    let (op, message) = error_parts(&reply);
    assert_eq!(op, "from_binary");
    assert!(
        message.starts_with("memory limit exceeded: needs 8.0 MiB, "),
        "{message}"
    );
    assert!(message.ends_with(" in use, limit 4.0 MiB"), "{message}");
    let failure = failure_of(&reply);
    assert_eq!(failure.get("need").and_then(Term::as_int), Some(8 << 20));
    assert_eq!(failure.get("limit").and_then(Term::as_int), Some(4 << 20));
    assert!(failure.get("in_use").and_then(Term::as_int).is_some(), "{reply}");
}

#[test]
fn a_request_to_another_generation_is_of_kind_stale_generation() {
    let mut w = Worker::start(&[]);
    w.send(request(1, 2, "sync", &[], &[], nil()), &[]);
    let (reply, _) = w.recv();
    assert_eq!(error_kind(&reply), "stale_generation");
    assert_eq!(
        error_parts(&reply),
        (
            "stale_generation".into(),
            "sync was sent to worker generation 2 but this worker is generation 3".into()
        )
    );
}

#[test]
fn a_malformed_request_is_of_kind_protocol() {
    let mut w = Worker::start(&["--log-level", "error"]);
    let short = Term::tuple(vec![Term::int(1), Term::int(3), Term::atom("sync"), ids(&[]), ids(&[])]);
    w.send(short, &[]);
    let (reply, _) = w.recv();
    assert_eq!(error_kind(&reply), "protocol");
    assert_eq!(
        error_parts(&reply),
        (
            "sync".into(),
            "request must be {seq, generation, op, outs, ins, attrs}, got a 5-tuple".into()
        )
    );
}

#[test]
fn an_error_mlx_raises_while_evaluating_is_of_kind_mlx() {
    let mut w = Worker::start(&[]);
    // A singular lower-triangular system: MLX fails it when it evaluates.
    w.upload_f32(1, &[2, 2], &[0.0, 0.0, 1.0, 1.0]);
    w.upload_f32(2, &[2], &[4.0, 2.0]);
    let attrs = map(vec![
        ("left_side", Term::atom("true")),
        ("lower", Term::atom("true")),
        ("transform_a", Term::atom("none")),
        ("type", ty("f", 32)),
    ]);
    w.request(0, "triangular_solve", &[3], &[1, 2], attrs);
    let reply = w.read(4, 3).unwrap_err();
    assert_eq!(error_kind(&reply), "mlx", "{reply}");
    let (op, message) = error_parts(&reply);
    assert_eq!(op, "to_binary");
    assert!(message.contains("triangular inversion failed"), "{message}");
}
