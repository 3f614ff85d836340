//! Malformed requests, one case each, beyond those in worker.rs: every one
//! gets a clear error (to its caller, into the ids it would define, or
//! unprompted with seq 0 when neither exists) and the worker keeps serving.

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;
use std::process::Stdio;
use std::time::Duration;

/// A worker whose log (warnings about each refused frame) is not shown.
fn start(extra: &[&str]) -> Worker {
    Worker::start_with(&[extra, &["--log-level", "error"]].concat(), Stdio::null())
}

/// The next frame must be an unprompted error; returns (op, message).
fn unprompted(w: &mut Worker) -> (String, String) {
    let (reply, _) = w.recv();
    let items = reply.as_tuple().expect("a tuple").to_vec();
    assert_eq!(items[1], Term::int(0), "expected an unprompted error, got {reply}");
    error_parts(&reply)
}

fn still_serving(w: &mut Worker, id: u64) {
    w.upload_f32(id, &[2], &[4.0, 5.0]);
    assert_eq!(w.read_f32(1_000_000 + id, id), vec![4.0, 5.0]);
}

#[test]
fn requests_of_the_wrong_shape() {
    let mut w = start(&[]);
    // Not a tuple: nothing can be read of it, so it is reported unprompted.
    w.send(Term::List(vec![Term::int(1)]), &[]);
    let (op, message) = unprompted(&mut w);
    assert_eq!(op, "protocol");
    assert!(message.contains("request must be a tuple"), "{message}");

    // A 4-tuple: its seq and outs can be read, so its caller hears and its out is poisoned.
    let short = Term::tuple(vec![Term::int(5), Term::int(3), Term::atom("add"), ids(&[9])]);
    w.send(short, &[]);
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "add");
    assert!(message.contains("got a 4-tuple"), "{message}");
    assert_eq!(error_parts(&w.read(6, 9).unwrap_err()), (op, message));

    // A negative seq.
    w.send(
        Term::tuple(vec![
            Term::int(-1),
            Term::int(3),
            Term::atom("sync"),
            ids(&[]),
            ids(&[]),
            nil(),
        ]),
        &[],
    );
    assert!(unprompted(&mut w).1.contains("seq must be a non-negative integer"));

    // An op that is not an atom.
    w.send(
        Term::tuple(vec![
            Term::int(7),
            Term::int(3),
            Term::Binary(b"add".to_vec()),
            ids(&[]),
            ids(&[]),
            nil(),
        ]),
        &[],
    );
    assert!(error_parts(&w.recv().0).1.contains("op must be an atom"));
    still_serving(&mut w, 1);
}

#[test]
fn bad_tensor_ids() {
    let mut w = start(&[]);
    w.upload_f32(1, &[1], &[1.0]);
    for bad in [Term::int(0), Term::int(-3), Term::atom("x"), Term::Int(1 << 64)] {
        w.send(request_with_ins(8, vec![Term::int(1), bad.clone()]), &[]);
        let (_, message) = error_parts(&w.recv().0);
        assert!(message.contains(&format!("bad tensor id {bad}")), "{message}");
    }
    // An id that was never defined, as a call's input.
    w.request(9, "metadata", &[], &[42], nil());
    assert!(error_parts(&w.recv().0).1.contains("unknown tensor id 42"));
    w.request(10, "eval", &[], &[1, 43], nil());
    assert!(error_parts(&w.recv().0).1.contains("unknown tensor id 43"));
    w.request(11, "to_binary", &[], &[1, 1], nil());
    assert!(error_parts(&w.recv().0)
        .1
        .contains("to_binary takes one tensor id, got 2"));
    still_serving(&mut w, 2);
}

fn request_with_ins(seq: u64, ins: Vec<Term>) -> Term {
    Term::tuple(vec![
        Term::int(seq),
        Term::int(3),
        Term::atom("add"),
        ids(&[5]),
        Term::List(ins),
        typed("f", 32),
    ])
}

#[test]
fn bad_dtypes_and_shapes_in_uploads() {
    let mut w = start(&[]);
    for (id, dtype) in [(1, ty("f", 8)), (2, Term::atom("float32")), (3, nil())] {
        let attrs = map(vec![("bytes", Term::int(4)), ("dtype", dtype), ("shape", ids(&[1]))]);
        w.send(request(0, 3, "from_binary", &[id], &[], attrs), &[0; 4]);
        let (op, message) = unprompted(&mut w);
        assert_eq!(op, "from_binary");
        assert!(message.contains("unsupported dtype"), "{message}");
        assert_eq!(error_parts(&w.read(id, id).unwrap_err()), (op, message));
    }
    let attrs = map(vec![
        ("bytes", Term::int(4)),
        ("dtype", ty("f", 32)),
        ("shape", Term::List(vec![Term::int(-1)])),
    ]);
    w.send(request(0, 3, "from_binary", &[4], &[], attrs), &[0; 4]);
    assert!(unprompted(&mut w)
        .1
        .contains("shape dimensions must be integers in 0..2^31"));
    // More payload than the tensor holds.
    w.send(
        request(0, 3, "from_binary", &[5], &[], tensor_attrs(&[1], "f", 32, 4)),
        &[0; 8],
    );
    assert!(unprompted(&mut w)
        .1
        .contains("payload of 8 bytes exceeds the tensor's 4 bytes"));
    // A byte count whose shape overflows.
    let huge = tensor_attrs(&[i32::MAX, i32::MAX, i32::MAX], "f", 64, 8);
    w.send(request(0, 3, "from_binary", &[6], &[], huge), &[0; 8]);
    assert!(unprompted(&mut w).1.contains("the shape's byte size overflows"));
    still_serving(&mut w, 7);
}

#[test]
fn broken_chunked_uploads() {
    let mut w = start(&[]);
    // A chunk for an id with no upload in progress.
    w.send(request(0, 3, "upload", &[1], &[], Term::int(0)), &[0; 4]);
    assert!(unprompted(&mut w).1.contains("no upload in progress for tensor id 1"));
    // A chunk at the wrong offset ends the upload and poisons its id.
    w.send(
        request(0, 3, "from_binary", &[2], &[], tensor_attrs(&[4], "f", 32, 16)),
        &[0; 4],
    );
    w.send(request(0, 3, "upload", &[2], &[], Term::int(8)), &[0; 4]);
    let (op, message) = unprompted(&mut w);
    assert_eq!(op, "upload");
    assert!(
        message.contains("does not continue tensor 2 (4 of 16 bytes received)"),
        "{message}"
    );
    assert_eq!(error_parts(&w.read(1, 2).unwrap_err()), (op, message));
    // A chunk that overruns the tensor.
    w.send(
        request(0, 3, "from_binary", &[3], &[], tensor_attrs(&[2], "f", 32, 8)),
        &[0; 4],
    );
    w.send(request(0, 3, "upload", &[3], &[], Term::int(4)), &[0; 8]);
    assert!(unprompted(&mut w).1.contains("does not continue tensor 3"));
    still_serving(&mut w, 4);
}

#[test]
fn payloads_on_ops_that_take_none() {
    let mut w = start(&[]);
    w.upload_f32(1, &[1], &[1.0]);
    w.send(request(0, 3, "add", &[2], &[1, 1], typed("f", 32)), &[1, 2, 3]);
    let (op, message) = unprompted(&mut w);
    assert_eq!(
        (op.as_str(), message.as_str()),
        ("add", "add takes no payload, got 3 bytes")
    );
    assert!(w.read(1, 2).is_err());
    still_serving(&mut w, 3);
}

#[test]
fn fire_and_forget_failures_with_no_id_to_carry_them_are_reported() {
    let mut w = start(&[]);
    w.request(0, "frobnicate", &[], &[], nil());
    assert_eq!(
        unprompted(&mut w),
        ("frobnicate".into(), "unknown op frobnicate".into())
    );
    w.request(0, "async_eval", &[], &[77], nil());
    w.request(0, "release", &[], &[78], nil());
    // Neither of those is an error (evaluation errors resurface at the next
    // read; releasing an unknown id is a no-op), so the next frame is the sync's.
    w.request(1, "sync", &[], &[], nil());
    assert_eq!(w.recv().0, moat_port::protocol::ok(1, nil()));
}

#[test]
fn stale_generations_poison_fire_and_forget_outputs() {
    let mut w = start(&[]);
    w.upload_f32(1, &[1], &[1.0]);
    w.send(request(0, 2, "add", &[2], &[1, 1], typed("f", 32)), &[]);
    let (op, message) = error_parts(&w.read(1, 2).unwrap_err());
    assert_eq!(op, "stale_generation");
    assert!(message.contains("add was sent to worker generation 2"), "{message}");
    // An upload from an old generation poisons its id too.
    w.send(
        request(0, 4, "from_binary", &[3], &[], tensor_attrs(&[1], "f", 32, 4)),
        &[0; 4],
    );
    assert_eq!(error_parts(&w.read(2, 3).unwrap_err()).0, "stale_generation");
    still_serving(&mut w, 4);
}

#[test]
fn a_header_over_the_header_limit_is_refused() {
    let mut w = start(&[]);
    let attrs = map(vec![("junk", Term::Binary(vec![b'x'; (1 << 20) + 1]))]);
    w.request(3, "sync", &[], &[], attrs);
    let (op, message) = unprompted(&mut w);
    assert_eq!(op, "protocol");
    assert!(
        message.contains("exceeds the packet") && message.contains("header limit"),
        "{message}"
    );
    still_serving(&mut w, 1);
}

/// Peak virtual memory of a process, in bytes: what it ever mapped, touched or not.
fn vm_peak(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmPeak:")).expect("VmPeak");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn an_oversized_frame_is_refused_before_anything_is_allocated_for_it() {
    let mut w = start(&["--max-frame-bytes", "1048576"]);
    still_serving(&mut w, 1);
    let before = vm_peak(w.pid());
    // A 1 GiB tensor in one frame: the header is honest, the frame too big.
    let size: usize = 1 << 30;
    let attrs = tensor_attrs(&[(size / 4) as i32], "f", 32, size);
    let header = moat_port::term::encode(&request(0, 3, "from_binary", &[2], &[], attrs));
    let mut start = ((4 + header.len() + size) as u32).to_be_bytes().to_vec();
    start.extend_from_slice(&(header.len() as u32).to_be_bytes());
    start.extend_from_slice(&header);
    w.send_raw(&start);
    let zeros = vec![0u8; 8 << 20];
    for _ in 0..size / zeros.len() {
        w.send_raw(&zeros);
    }
    w.request(7, "sync", &[], &[], nil());
    let (op, message) = unprompted(&mut w);
    assert_eq!(w.recv().0, moat_port::protocol::ok(7, nil()));
    assert_eq!(op, "protocol");
    assert!(
        message.contains("frame of more than 1048576 bytes refused"),
        "{message}"
    );
    // Half the frame: a buffer for it would show whole, while each worker
    // thread's first malloc may reserve a 64 MiB glibc arena (CI once saw
    // three, 192 MiB, from threads that first allocated during the stream).
    let grown = vm_peak(w.pid()) - before;
    assert!(
        grown < (size / 2) as u64,
        "the worker mapped {} MiB for a frame it refused",
        grown >> 20
    );
    common::report::row(
        "malformed",
        "oversized frame: 1 GiB against a 1 MiB cap",
        1,
        1,
        0,
        &format!(
            "refused before allocating: the worker's peak virtual size grew {} MiB; still serving",
            grown >> 20
        ),
    );
    assert_eq!(error_parts(&w.read(8, 2).unwrap_err()).0, "protocol");
    still_serving(&mut w, 3);
    w.close(Duration::from_secs(2));
}

/// One frame as a batch's inner packet: `<<len::32, frame>>`.
fn inner(header: Term, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    moat_port::frame::write_frame(&mut out, &header, payload).unwrap();
    out
}

/// A batch packet (protocol.md §1, "Batches") of `body`'s inner packets.
fn batch(body: &[u8]) -> Vec<u8> {
    let mut out = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    out.extend([0, 0, 0, 0]);
    out.extend(body);
    out
}

#[test]
fn a_batch_is_served_frame_by_frame_in_order() {
    let mut w = start(&[]);
    let g = w.generation;
    let attrs = moat_port::protocol::map(vec![("type", ty("f", 32))]);
    let body = [
        inner(
            request(0, g, "from_binary", &[1], &[], tensor_attrs(&[2], "f", 32, 8)),
            &f32_bytes(&[1.0, 2.0]),
        ),
        inner(request(0, g, "add", &[2], &[1, 1], attrs.clone()), &[]),
        inner(request(7, g, "to_binary", &[], &[2], nil()), &[]),
        inner(request(0, g, "add", &[3], &[2, 1], attrs), &[]),
        inner(request(8, g, "to_binary", &[], &[3], nil()), &[]),
    ]
    .concat();
    w.send_raw(&batch(&body));
    for (seq, want) in [(7, [2.0f32, 4.0]), (8, [3.0, 6.0])] {
        let (reply, payload) = w.recv();
        assert_eq!(reply.as_tuple().unwrap()[1], Term::int(seq), "{reply}");
        assert_eq!(payload, f32_bytes(&want));
    }
    still_serving(&mut w, 50);
}

#[test]
fn malformed_batches_are_refused_and_the_worker_keeps_serving() {
    let mut w = start(&["--max-frame-bytes", "4096"]);
    let g = w.generation;
    // An inner packet longer than the rest of its batch.
    w.send_raw(&batch(&[0, 0, 0, 50, 1, 2, 3]));
    let (op, message) = unprompted(&mut w);
    assert_eq!(op, "protocol");
    assert!(message.contains("exceeds the 3 bytes left in its batch"), "{message}");
    // A batch with no frames, then a batch inside a batch.
    w.send_raw(&[0, 0, 0, 4, 0, 0, 0, 0]);
    assert!(unprompted(&mut w).1.contains("a batch packet with no frames"));
    let nested = batch(&inner(request(0, g, "sync", &[], &[], nil()), &[]));
    w.send_raw(&batch(&nested));
    assert!(unprompted(&mut w).1.contains("a batch inside a batch"));
    // An oversized frame inside a batch is refused alone; the frames around it are served.
    let body = [
        inner(
            request(0, g, "from_binary", &[5], &[], tensor_attrs(&[2000], "f", 32, 8000)),
            &[0u8; 8000],
        ),
        inner(request(9, g, "sync", &[], &[], nil()), &[]),
    ]
    .concat();
    w.send_raw(&batch(&body));
    let (op, message) = unprompted(&mut w);
    assert_eq!(op, "protocol");
    assert!(message.contains("frame of more than 4096 bytes refused"), "{message}");
    assert_eq!(w.recv().0, moat_port::protocol::ok(9, nil()));
    // A zero inner length ends its batch with one error, however many zeros
    // follow it, and the call after it in the batch is never read; a
    // well-framed bad inner packet before it is refused and reading goes on.
    let body = [
        inner(request(10, g, "sync", &[], &[], nil()), &[]),
        vec![0, 0, 0, 2, 7, 7],
        vec![0; 64],
        inner(request(11, g, "sync", &[], &[], nil()), &[]),
    ]
    .concat();
    w.send_raw(&batch(&body));
    assert_eq!(w.recv().0, moat_port::protocol::ok(10, nil()));
    assert!(unprompted(&mut w)
        .1
        .contains("an inner packet shorter than its header length"));
    let (op, message) = unprompted(&mut w);
    assert_eq!(op, "protocol");
    assert!(message.contains("an inner packet length of 0"), "{message}");
    assert!(message.contains("is dropped"), "{message}");
    w.send(request(12, g, "sync", &[], &[], nil()), &[]);
    assert_eq!(
        w.recv().0,
        moat_port::protocol::ok(12, nil()),
        "one error for the batch, not one per 4 bytes"
    );
    still_serving(&mut w, 60);
}
