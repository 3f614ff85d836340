//! Memory statistics and the worker's own memory limit, through a real
//! worker.

mod common;

use common::*;
use moat_port::term::Term;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A blocking call with no inputs: its result, or the error tuple.
fn call(w: &mut Worker, seq: u64, op: &str, attrs: Term) -> Result<Term, Term> {
    w.request(seq, op, &[], &[], attrs);
    let (reply, _) = w.recv();
    let items = reply.as_tuple().expect("reply").to_vec();
    assert_eq!(items[1], Term::int(seq));
    if items[0].is_atom("ok") {
        Ok(items[2].clone())
    } else {
        Err(reply)
    }
}

fn stat(w: &mut Worker, seq: u64, key: &str) -> u64 {
    let info = call(w, seq, "memory_info", nil()).expect("memory_info");
    info.get(key)
        .and_then(Term::as_int)
        .unwrap_or_else(|| panic!("no {key} in {info}")) as u64
}

/// A 1 MiB f32 tensor of ones.
fn upload_mib(w: &mut Worker, id: u64) {
    w.upload_f32(id, &[512, 512], &vec![1.0; 512 * 512]);
}

#[test]
fn memory_info_reports_the_allocator_and_the_registry() {
    let mut w = Worker::start(&[]);
    let info = call(&mut w, 1, "memory_info", nil()).unwrap();
    for key in ["active", "peak", "cache", "limit", "cache_limit", "tensors"] {
        assert!(
            info.get(key).and_then(Term::as_int).is_some(),
            "{key} missing from {info}"
        );
    }
    assert!(stat(&mut w, 2, "limit") > 0);
    upload_mib(&mut w, 1);
    w.request(0, "add", &[2], &[1, 1], typed("f", 32));
    w.read_f32(3, 2);
    assert_eq!(stat(&mut w, 4, "active"), 2 * MIB);
    assert_eq!(stat(&mut w, 5, "tensors"), 2);
    w.request(0, "release", &[], &[2], nil());
    assert_eq!(stat(&mut w, 6, "active"), MIB);
    assert_eq!(stat(&mut w, 7, "cache"), MIB, "freed buffers stay cached");
    assert_eq!(stat(&mut w, 8, "peak"), 2 * MIB);
    call(&mut w, 9, "reset_peak_memory", nil()).unwrap();
    assert_eq!(stat(&mut w, 10, "peak"), 0, "MLX starts the peak over from zero");
    upload_mib(&mut w, 3);
    assert_eq!(stat(&mut w, 13, "peak"), 2 * MIB);
    call(&mut w, 11, "clear_cache", nil()).unwrap();
    assert_eq!(stat(&mut w, 12, "cache"), 0);
    w.close(Duration::from_secs(1));
}

#[test]
fn limits_return_the_previous_value_and_refuse_bad_counts() {
    let mut w = Worker::start(&[]);
    let default = stat(&mut w, 1, "limit");
    assert_eq!(
        call(&mut w, 2, "set_memory_limit", Term::int(64 * MIB)).unwrap(),
        Term::int(default)
    );
    assert_eq!(
        call(&mut w, 3, "set_memory_limit", Term::int(default)).unwrap(),
        Term::int(64 * MIB)
    );
    assert_eq!(
        call(&mut w, 4, "set_cache_limit", Term::int(0u64)).unwrap(),
        Term::int(default)
    );
    assert_eq!(stat(&mut w, 5, "cache_limit"), 0);
    upload_mib(&mut w, 1);
    w.request(0, "release", &[], &[1], nil());
    assert_eq!(stat(&mut w, 6, "cache"), 0, "a cache limit of 0 keeps nothing");
    let (op, message) = error_parts(&call(&mut w, 7, "set_memory_limit", Term::int(-1)).unwrap_err());
    assert_eq!(op, "set_memory_limit");
    assert!(message.contains("takes a byte count"), "{message}");
    w.close(Duration::from_secs(1));
}

#[test]
fn an_upload_over_the_limit_is_refused_and_the_worker_keeps_serving() {
    let mut w = Worker::start(&[]);
    call(&mut w, 1, "set_memory_limit", Term::int(4 * MIB)).unwrap();
    w.upload_f32(1, &[2048, 1024], &vec![0.5; 2048 * 1024]);
    // The refusal of a fire-and-forget frame is reported unprompted.
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "from_binary");
    assert!(message.contains("memory limit exceeded: needs 8.0 MiB"), "{message}");
    let (op, message) = error_parts(&w.read(2, 1).unwrap_err());
    assert_eq!(op, "from_binary");
    assert!(message.contains("memory limit exceeded"), "{message}");
    upload_mib(&mut w, 3);
    assert_eq!(w.read_f32(3, 3).len(), 512 * 512);
    w.close(Duration::from_secs(1));
}

#[test]
fn an_op_whose_output_exceeds_the_limit_fails_when_it_is_built() {
    let mut w = Worker::start(&[]);
    call(&mut w, 1, "set_memory_limit", Term::int(16 * MIB)).unwrap();
    w.upload_f32(1, &[1], &[2.0]);
    // The broadcast is a view: it allocates nothing. The sum of two does.
    let huge = moat_port::protocol::map(vec![("shape", moat_port::protocol::shape_term(&[1 << 30]))]);
    w.request(0, "broadcast_to", &[2], &[1], huge);
    w.request(0, "add", &[3], &[2, 2], typed("f", 32));
    w.request(0, "add", &[4], &[3, 1], typed("f", 32));
    let (op, message) = error_parts(&w.read(2, 4).unwrap_err());
    assert_eq!(op, "add");
    assert!(message.contains("memory limit exceeded: needs 4.0 GiB"), "{message}");
    assert_eq!(w.read_f32(3, 1), vec![2.0]);
    w.close(Duration::from_secs(1));
}

#[test]
fn views_count_nothing() {
    let mut w = Worker::start(&[]);
    let why = "an upload is copied into the CUDA allocator's memory, so the peak counts more than the views";
    if w.skip_on_gpu("views_count_nothing", why) {
        return;
    }
    call(&mut w, 1, "set_memory_limit", Term::int(16 * MIB)).unwrap();
    w.upload_f32(1, &[1], &[2.0]);
    let wide = moat_port::protocol::map(vec![("shape", moat_port::protocol::shape_term(&[8 << 20]))]);
    w.request(0, "broadcast_to", &[2], &[1], wide);
    let sum_attrs = moat_port::protocol::map(vec![
        ("axes", ids(&[0])),
        ("keep_axes", Term::atom("false")),
        ("type", ty("f", 32)),
    ]);
    w.request(0, "sum", &[3], &[2], sum_attrs);
    assert_eq!(w.read_f32(2, 3), vec![2.0 * (8 << 20) as f32]);
    // A reshape of an evaluated dense tensor is a view as well.
    w.upload_f32(4, &[1024, 1024], &vec![1.0; 1 << 20]);
    for (id, shape) in [(5, [1 << 20, 1]), (6, [1, 1 << 20]), (7, [512, 2048])] {
        let attrs = moat_port::protocol::map(vec![("shape", moat_port::protocol::shape_term(&shape))]);
        w.request(0, "reshape", &[id], &[4], attrs);
    }
    w.request(3, "eval", &[], &[5, 6, 7], nil());
    assert!(w.recv().0.as_tuple().unwrap()[0].is_atom("ok"));
    assert!(
        stat(&mut w, 4, "peak") < 5 * MIB,
        "neither the sum of the broadcast nor the reshapes copied"
    );
    w.close(Duration::from_secs(1));
}

#[test]
fn a_lazy_chain_whose_results_are_all_held_does_not_evaluate_past_the_limit() {
    let mut w = Worker::start(&[]);
    call(&mut w, 1, "set_memory_limit", Term::int(8 * MIB)).unwrap();
    upload_mib(&mut w, 1);
    // Twelve 1 MiB steps, every one a registered tensor: each fits when it
    // is built, all of them do not.
    for id in 2..14 {
        w.request(0, "add", &[id], &[id - 1, 1], typed("f", 32));
    }
    let (op, message) = error_parts(&w.read(2, 13).unwrap_err());
    assert_eq!(op, "to_binary");
    assert!(
        message.contains("memory limit exceeded: needs 1.0 MiB, 8.0 MiB in use, limit 8.0 MiB"),
        "{message}"
    );
    assert!(stat(&mut w, 3, "peak") <= 8 * MIB);
    // Not poisoned: with room, the same tensor evaluates.
    call(&mut w, 4, "set_memory_limit", Term::int(64 * MIB)).unwrap();
    assert!(w.read_f32(5, 13).iter().all(|v| *v == 13.0));
    w.close(Duration::from_secs(1));
}

#[test]
fn a_lazy_chain_longer_than_the_limit_evaluates_in_steps() {
    let mut w = Worker::start(&[]);
    let why = "its byte arithmetic is the CPU allocator's: the CUDA allocator rounds and frees the 1 MiB steps otherwise, and 8 MiB refuses the chain";
    if w.skip_on_gpu("a_lazy_chain_longer_than_the_limit_evaluates_in_steps", why) {
        return;
    }
    call(&mut w, 1, "set_memory_limit", Term::int(8 * MIB)).unwrap();
    upload_mib(&mut w, 1);
    // Forty 1 MiB steps, of which only the last is registered: 40 MiB of
    // results in all, but MLX frees each step once the next has read it.
    for id in 2..42 {
        w.request(0, "add", &[id], &[id - 1, 1], typed("f", 32));
        if id > 2 {
            w.request(0, "release", &[], &[id - 1], nil());
        }
    }
    w.request(2, "eval", &[], &[41], nil());
    assert_eq!(w.recv().0.as_tuple().unwrap()[0], Term::atom("ok"));
    assert!(stat(&mut w, 3, "peak") <= 8 * MIB, "the limit held during evaluation");
    assert!(w.read_f32(4, 41).iter().all(|v| *v == 41.0));
    assert_eq!(stat(&mut w, 5, "active"), 2 * MIB);
    w.close(Duration::from_secs(1));
}

#[test]
fn an_async_evaluation_keeps_its_memory_reserved_until_it_finishes() {
    let mut w = Worker::start(&[]);
    call(&mut w, 1, "set_memory_limit", Term::int(128 * MIB)).unwrap();
    let ones = |mib: i64| {
        moat_port::protocol::map(vec![
            ("shape", ints(&[mib << 18])),
            ("value", Term::Binary(1.0f32.to_le_bytes().to_vec())),
            ("type", ty("f", 32)),
        ])
    };
    for id in [1, 2, 3] {
        w.request(0, "constant", &[id], &[], ones(32));
    }
    w.request(0, "constant", &[4], &[], ones(48));
    // 96 MiB start in the background; 48 more do not fit next to them,
    // whether or not they have been allocated yet.
    w.request(0, "async_eval", &[], &[1, 2, 3], nil());
    w.request(2, "eval", &[], &[4], nil());
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "eval", "{message}");
    assert!(message.contains("memory limit exceeded: needs 48.0 MiB"), "{message}");
    assert!(stat(&mut w, 3, "peak") <= 128 * MIB);
    // The three results, and the constants' scalar values.
    assert!((96 * MIB..96 * MIB + 64).contains(&stat(&mut w, 4, "active")));
    w.close(Duration::from_secs(1));
}

#[test]
fn the_cache_is_cleared_when_only_it_stands_in_the_way() {
    let mut w = Worker::start(&[]);
    call(&mut w, 1, "set_memory_limit", Term::int(3 * MIB)).unwrap();
    upload_mib(&mut w, 1);
    upload_mib(&mut w, 2);
    w.request(0, "release", &[], &[1, 2], nil());
    assert_eq!(stat(&mut w, 2, "cache"), 2 * MIB);
    w.upload_f32(3, &[1024, 512], &vec![1.0; 1024 * 512]);
    assert_eq!(w.read_f32(4, 3).len(), 1024 * 512);
    assert!(stat(&mut w, 5, "cache") + stat(&mut w, 6, "active") <= 3 * MIB);
    w.close(Duration::from_secs(1));
}

/// The worker's minor page faults so far (field 10 of /proc/PID/stat).
fn minor_faults(w: &Worker) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", w.pid())).expect("/proc/PID/stat");
    let fields: Vec<&str> = stat.rsplit_once(") ").expect("stat").1.split_whitespace().collect();
    fields[7].parse().expect("minflt")
}

#[test]
#[cfg(target_os = "linux")]
fn a_fresh_output_reuses_freed_memory_instead_of_faulting_its_pages_in() {
    // Each round evaluates 8 exps of 4 MB (1M f32) and frees them. With
    // glibc's defaults freed buffers went back to the system and the next
    // ones were faulted in page by page (~6 us a fault on a VM: more than
    // the exp; bench/kernels.exs counted 30-570 faults an op).
    let mut w = Worker::start(&["--device", "cpu"]);
    if w.skip_on_gpu("page faults", "the outputs live on the GPU") {
        return;
    }
    let n = 1 << 20;
    w.upload_f32(1, &[n], &vec![0.5; n as usize]);
    w.upload_f32(2, &[n / 4], &vec![0.5; n as usize / 4]);
    // The outputs of a round are released after the next round's, as
    // Moat.Backend's finalizers do (late, and interleaved).
    // Each round also runs a chain of 1 MB intermediates, as GELU's.
    let outs = |seq: u64| -> Vec<u64> { (0..14).map(|i| 100 * (seq % 3) + 10 + i).collect() };
    let round = |w: &mut Worker, seq: u64| {
        let o = outs(seq);
        for &o in &o[..8] {
            w.request(0, "exp", &[o], &[1], typed("f", 32));
        }
        w.request(0, "tanh", &[o[8]], &[2], typed("f", 32));
        for i in 9..14 {
            w.request(0, "multiply", &[o[i]], &[o[i - 1], 2], typed("f", 32));
        }
        call_with(w, seq, "eval", &outs(seq)).expect("eval");
        if seq > 1 {
            w.request(0, "release", &[], &outs(seq - 1), nil());
        }
    };
    round(&mut w, 1);
    round(&mut w, 2);
    let before = minor_faults(&w);
    for seq in 3..13 {
        round(&mut w, seq);
    }
    // 38 MB (9,728 pages) of outputs a round: glibc's defaults faulted
    // ~330 of them in anew each round here, the worker's settings ~20.
    let per_round = (minor_faults(&w) - before) / 10;
    assert!(
        per_round < 100,
        "{per_round} page faults a round of 38 MB of fresh outputs"
    );
    w.close(Duration::from_secs(1));
}

/// A blocking call on tensors `ins`: its result, or the error tuple.
fn call_with(w: &mut Worker, seq: u64, op: &str, ins: &[u64]) -> Result<Term, Term> {
    w.request(seq, op, &[], ins, nil());
    let (reply, _) = w.recv();
    let items = reply.as_tuple().expect("reply").to_vec();
    assert_eq!(items[1], Term::int(seq));
    if items[0].is_atom("ok") {
        Ok(items.get(2).cloned().unwrap_or_else(nil))
    } else {
        Err(reply)
    }
}
