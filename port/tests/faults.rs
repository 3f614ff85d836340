//! The `:fault` op of the test build (feature `fault-injection`): each kind
//! takes a real worker process down the way it says. The Elixir reliability
//! suite builds on these to prove that the VM and every caller survive.
//!
//! Run with `cargo test --release -p moat_port --features fault-injection
//! --target-dir target/fault --test faults` (bin/test does).

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

fn fault(kind: &str, extra: Vec<(&str, Term)>) -> Term {
    let mut pairs = vec![("kind", Term::atom(kind))];
    pairs.extend(extra);
    map(pairs)
}

/// Starts a quiet worker, sends `attrs` as a `:fault` call, and returns how
/// the worker ended.
fn crash_with(attrs: Term) -> ExitStatus {
    let mut w = Worker::start_with(&["--log-level", "error"], Stdio::null());
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    assert_eq!(w.read_f32(1, 1), vec![1.0, 2.0]);
    w.request(2, "fault", &[], &[], attrs);
    // An armed fault replies before it fires; anything else is a failure.
    while let Some((reply, _)) = w.try_recv() {
        assert_eq!(
            reply,
            moat_port::protocol::ok(2, nil()),
            "the worker answered instead of dying"
        );
    }
    w.wait_exit(Duration::from_secs(5))
}

#[test]
fn each_signal_kind_kills_the_worker_with_that_signal() {
    for (kind, signal) in [("sigsegv", 11), ("sigfpe", 8), ("sigabrt", 6), ("sigkill", 9)] {
        let status = crash_with(fault(kind, vec![]));
        assert_eq!(status.signal(), Some(signal), "{kind}: {status}");
    }
}

#[test]
fn a_panic_or_an_exit_ends_the_worker_with_a_status() {
    assert_eq!(crash_with(fault("panic", vec![])).code(), Some(101));
    assert_eq!(crash_with(fault("exit", vec![("code", Term::int(7))])).code(), Some(7));
}

#[test]
fn a_panic_on_any_thread_of_the_worker_ends_it() {
    // Armed faults fire on a thread of their own: a panic on a thread other
    // than the session's (the reader's, the writer's) must not leave a
    // half-alive worker.
    let status = crash_with(fault("panic", vec![("delay_ms", Term::int(0))]));
    assert_eq!(status.code(), Some(101));
}

#[test]
fn an_armed_fault_lands_in_the_middle_of_work() {
    let mut w = Worker::start_with(&["--log-level", "error"], Stdio::null());
    let n = 512;
    w.upload_f32(1, &[n, n], &vec![0.001; (n * n) as usize]);
    for id in 2..100 {
        w.request(0, "matmul", &[id], &[id - 1, 1], typed("f", 32));
    }
    w.request(
        0,
        "fault",
        &[],
        &[],
        fault("sigsegv", vec![("delay_ms", Term::int(30))]),
    );
    // The read starts evaluating the chain; the fault lands during it.
    w.request(1, "to_binary", &[], &[99], nil());
    let reply = w.try_recv();
    assert!(reply.is_none(), "the chain finished before the fault fired: {reply:?}");
    assert_eq!(w.wait_exit(Duration::from_secs(5)).signal(), Some(11));
}

#[test]
fn a_sleep_blocks_the_session_and_then_replies() {
    let mut w = Worker::start(&[]);
    w.request(1, "fault", &[], &[], fault("sleep", vec![("ms", Term::int(50))]));
    let start = std::time::Instant::now();
    assert_eq!(w.recv().0, moat_port::protocol::ok(1, nil()));
    assert!(start.elapsed() >= Duration::from_millis(40));
}

#[test]
fn bad_fault_attrs_are_errors_not_crashes() {
    let mut w = Worker::start(&[]);
    w.request(1, "fault", &[], &[], fault("meteor", vec![]));
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "fault");
    assert!(message.contains("unknown fault"), "{message}");
    w.request(2, "fault", &[], &[], fault("exit", vec![]));
    assert!(error_parts(&w.recv().0).1.contains("needs an integer code"));
    w.upload_f32(1, &[1], &[3.0]);
    assert_eq!(w.read_f32(3, 1), vec![3.0]);
}

/// While the session serves a long request, the reader thread reads the
/// frames behind it (port/src/input.rs): an `upload_file`, which the reader
/// answers itself, is answered before the sleeping request is.
#[test]
fn frames_behind_a_long_request_are_read_while_it_runs() {
    let mut w = Worker::start(&["--log-level", "error"]);
    w.request(1, "fault", &[], &[], fault("sleep", vec![("ms", Term::int(1500))]));
    w.request(2, "upload_file", &[5], &[], tensor_attrs(&[4], "f", 32, 16));
    let (first, _) = w.recv();
    let items = first.as_tuple().expect("reply tuple").to_vec();
    assert_eq!((items[0].as_atom(), &items[1]), (Some("ok"), &Term::int(2)), "{first}");
    assert_eq!(w.recv().0, moat_port::protocol::ok(1, nil()));
    // Then the session reads again, and serves in order as before.
    w.upload_f32(6, &[2], &[1.0, 2.0]);
    assert_eq!(w.read_f32(3, 6), vec![1.0, 2.0]);
}
