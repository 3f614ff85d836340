//! The worker as a black box: real process, real frames.

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;
use std::time::Duration;

#[test]
fn hello_announces_version_mlx_and_devices() {
    // The last `--generation` wins over the harness's own.
    let w = Worker::start(&["--generation", "7"]);
    let items = w.hello.as_tuple().unwrap();
    assert!(items[0].is_atom("hello"));
    assert_eq!(items[1], Term::int(1));
    let info = &items[2];
    assert_eq!(info.get("mlx"), Some(&Term::Binary(b"0.32.4".to_vec())));
    assert_eq!(info.get("generation"), Some(&Term::int(7)));
    assert_eq!(info.get("os_pid"), Some(&Term::int(w.pid())));
    assert!(info
        .get("devices")
        .unwrap()
        .as_list()
        .unwrap()
        .contains(&Term::atom("cpu")));
    assert!(w.close(Duration::from_secs(1)).success());
}

#[test]
fn computes_and_reads_back() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    w.upload_f32(2, &[2, 2], &[10.0, 20.0, 30.0, 40.0]);
    w.request(0, "add", &[3], &[1, 2], typed("f", 32));
    w.request(0, "matmul", &[4], &[1, 2], typed("f", 32));
    let sum_attrs = moat_port::protocol::map(vec![
        ("axes", ids(&[0, 1])),
        ("keep_axes", Term::atom("false")),
        ("type", Term::tuple(vec![Term::atom("f"), Term::int(32)])),
    ]);
    w.request(0, "sum", &[5], &[3], sum_attrs);
    w.upload_f32(6, &[2], &[1.5, 2.5]);
    w.request(0, "astype", &[7], &[6], typed("s", 32));
    let (_, ints) = w.read(4, 7).unwrap();
    assert_eq!(ints, [1i32.to_le_bytes(), 2i32.to_le_bytes()].concat());
    assert_eq!(w.read_f32(1, 3), vec![11.0, 22.0, 33.0, 44.0]);
    assert_eq!(w.read_f32(2, 4), vec![70.0, 100.0, 150.0, 220.0]);
    let (meta, data) = w.read(3, 5).unwrap();
    assert_eq!(meta.get("shape"), Some(&Term::nil()));
    assert_eq!(f32::from_le_bytes(data[..4].try_into().unwrap()), 110.0);
    w.close(Duration::from_secs(1));
}

#[test]
fn a_failed_op_poisons_its_dependents_and_names_itself() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2, 3], &[0.0; 6]);
    w.upload_f32(2, &[2, 2], &[0.0; 4]);
    w.request(0, "matmul", &[3], &[1, 2], typed("f", 32));
    w.request(0, "add", &[4], &[3, 3], typed("f", 32));
    let (op, message) = error_parts(&w.read(1, 4).unwrap_err());
    assert_eq!(op, "matmul");
    assert!(message.contains("[matmul]"), "{message}");
    // The healthy tensors are untouched.
    assert_eq!(w.read_f32(2, 2), vec![0.0; 4]);
}

#[test]
fn unknown_ops_ids_arity_and_attrs_are_clear_errors() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.request(0, "frobnicate", &[2], &[1], typed("f", 32));
    assert_eq!(
        error_parts(&w.read(1, 2).unwrap_err()),
        ("frobnicate".into(), "unknown op frobnicate".into())
    );
    w.request(0, "add", &[3], &[1], typed("f", 32));
    assert!(error_parts(&w.read(2, 3).unwrap_err())
        .1
        .contains("add takes 2 inputs, got 1"));
    w.request(0, "add", &[4], &[1, 99], typed("f", 32));
    assert!(error_parts(&w.read(3, 4).unwrap_err())
        .1
        .contains("unknown tensor id 99"));
    w.request(
        0,
        "astype",
        &[5],
        &[1],
        moat_port::protocol::map(vec![("type", Term::atom("float"))]),
    );
    assert!(error_parts(&w.read(4, 5).unwrap_err())
        .1
        .contains("unsupported type :float"));
}

#[test]
fn redefining_an_id_leaves_its_tensor_and_reports_the_error() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    // Fire-and-forget: nothing waits, so the error comes unprompted; the
    // request's other out is poisoned with it.
    w.request(
        0,
        "top_k",
        &[2, 1],
        &[1],
        map(vec![("k", Term::int(1)), ("index_type", ty("s", 64))]),
    );
    let (reply, _) = w.recv();
    assert_eq!(reply.as_tuple().unwrap()[1], Term::int(0), "{reply}");
    assert_eq!(
        error_parts(&reply),
        ("top_k".into(), "tensor id 1 is already defined".into())
    );
    assert_eq!(
        error_parts(&w.read(1, 2).unwrap_err()),
        ("top_k".into(), "tensor id 1 is already defined".into())
    );
    // A call gets the error itself.
    w.request(2, "add", &[1], &[1, 1], typed("f", 32));
    assert_eq!(
        error_parts(&w.recv().0),
        ("add".into(), "tensor id 1 is already defined".into())
    );
    assert_eq!(w.read_f32(3, 1), vec![1.0, 2.0]);
}

#[test]
fn release_and_async_eval_sent_as_calls_are_answered() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[1], &[1.0]);
    w.request(5, "async_eval", &[], &[1], nil());
    assert_eq!(w.recv().0, Term::tuple(vec![Term::atom("ok"), Term::int(5), nil()]));
    w.request(6, "release", &[], &[1], nil());
    assert_eq!(w.recv().0, Term::tuple(vec![Term::atom("ok"), Term::int(6), nil()]));
    assert!(error_parts(&w.read(7, 1).unwrap_err())
        .1
        .contains("unknown tensor id 1"));
}

#[test]
fn stale_generations_are_refused() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[1], &[1.0]);
    w.send(request(9, 2, "to_binary", &[], &[1], nil()), &[]);
    let (reply, _) = w.recv();
    let (op, message) = error_parts(&reply);
    assert_eq!(op, "stale_generation");
    assert!(
        message.contains("generation 2") && message.contains("generation 3"),
        "{message}"
    );
}

#[test]
fn large_tensors_travel_in_chunks_both_ways() {
    let mut w = Worker::start(&["--chunk-bytes", "1000", "--max-frame-bytes", "4096"]);
    let values: Vec<f32> = (0..10_000).map(|i| i as f32).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let attrs = tensor_attrs(&[10_000], "f", 32, bytes.len());
    w.send(request(0, 3, "from_binary", &[1], &[], attrs), &bytes[..1000]);
    for (i, chunk) in bytes[1000..].chunks(1000).enumerate() {
        w.send(
            request(0, 3, "upload", &[1], &[], Term::int(1000 * (i as u64 + 1))),
            chunk,
        );
    }
    assert_eq!(w.read_f32(1, 1), values);
}

#[test]
fn oversized_and_undecodable_frames_are_refused_and_the_worker_keeps_serving() {
    let mut w = Worker::start(&["--max-frame-bytes", "4096"]);
    let attrs = tensor_attrs(&[2048], "f", 32, 8192);
    w.send(request(0, 3, "from_binary", &[1], &[], attrs), &[0u8; 8192]);
    // Reported unprompted (no call waits on a fire-and-forget frame)...
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "protocol");
    assert!(message.contains("frame of more than 4096 bytes refused"), "{message}");
    // ...and poisoned into the id it would have defined.
    assert_eq!(error_parts(&w.read(1, 1).unwrap_err()), (op, message));

    // A packet whose header is not a term.
    w.send_raw(&[0, 0, 0, 7, 0, 0, 0, 3, 1, 2, 3]);
    let (reply, _) = w.recv();
    assert_eq!(error_parts(&reply).0, "protocol");

    w.upload_f32(2, &[1], &[5.0]);
    assert_eq!(w.read_f32(2, 2), vec![5.0]);
}

#[test]
fn an_upload_whose_bytes_do_not_match_its_shape_is_refused() {
    let mut w = Worker::start(&[]);
    let attrs = tensor_attrs(&[4], "f", 32, 12);
    w.send(request(0, 3, "from_binary", &[1], &[], attrs), &[0u8; 12]);
    let unprompted = w.recv().0;
    let (op, message) = error_parts(&w.read(1, 1).unwrap_err());
    assert_eq!(error_parts(&unprompted), (op.clone(), message.clone()));
    assert_eq!(op, "from_binary");
    assert!(message.contains("need 16"), "{message}");
}

#[test]
fn release_forgets_ids() {
    let mut w = Worker::start(&[]);
    w.upload_f32(1, &[1], &[1.0]);
    w.request(0, "release", &[], &[1], nil());
    assert!(error_parts(&w.read(1, 1).unwrap_err())
        .1
        .contains("unknown tensor id 1"));
}

#[test]
fn the_worker_exits_when_its_input_closes() {
    let w = Worker::start(&[]);
    assert!(w.close(Duration::from_secs(1)).success());
}

/// The session reads its own input while idle and the reader thread reads
/// behind a long request (port/src/input.rs): whichever reads, requests are
/// served in the order they were sent. Bursts of casts and reads, some
/// behind an evaluation long enough for the reader thread to take over,
/// some sent one at a time: every reply comes in order, with its own value.
#[test]
fn requests_are_served_in_order_whichever_thread_reads_them() {
    let mut w = Worker::start(&["--log-level", "error"]);
    let n = 384;
    w.upload_f32(1, &[n, n], &vec![1.0 / n as f32; (n * n) as usize]);
    w.upload_f32(2, &[4], &[0.0, 1.0, 2.0, 3.0]);
    let mut next_id = 10;
    let mut seq = 0;
    for round in 0..60u64 {
        let mut expected = Vec::new();
        // A slow read first in some rounds: a chain of products whose
        // evaluation outlasts the reader's take-over.
        if round % 3 == 0 {
            let mut prev = 1;
            for _ in 0..6 {
                w.request(0, "matmul", &[next_id], &[prev, 1], typed("f", 32));
                prev = next_id;
                next_id += 1;
            }
            w.request(
                0,
                "sum",
                &[next_id],
                &[prev],
                map(vec![("axes", ints(&[0, 1])), ("keep_axes", Term::atom("false"))]),
            );
            seq += 1;
            w.request(seq, "to_binary", &[], &[next_id], nil());
            expected.push((seq, vec![n as f32]));
            next_id += 1;
        }
        // Then small adds, each read back, all sent before any reply is read.
        for k in 0..(1 + round % 5) {
            let c = (round * 10 + k) as f32;
            w.upload_f32(next_id, &[1], &[c]);
            w.request(0, "add", &[next_id + 1], &[2, next_id], nil());
            seq += 1;
            w.request(seq, "to_binary", &[], &[next_id + 1], nil());
            expected.push((seq, vec![c, c + 1.0, c + 2.0, c + 3.0]));
            next_id += 2;
        }
        for (want_seq, want) in expected {
            let (header, payload) = w.recv();
            let items = header.as_tuple().expect("reply tuple").to_vec();
            assert_eq!(
                (items[0].as_atom(), &items[1]),
                (Some("ok"), &Term::int(want_seq)),
                "{header}"
            );
            let got: Vec<f32> = payload
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let close = got.len() == want.len()
                && got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| (a - b).abs() <= 1e-2 * b.abs().max(1.0));
            assert!(close, "seq {want_seq}: {got:?}, expected {want:?}");
        }
    }
}
