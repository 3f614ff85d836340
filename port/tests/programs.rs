//! Programs (protocol.md §6, "Programs"): defined once, run as one
//! fire-and-forget frame, with `while` and `cond` evaluated in the worker
//! and every eager guard holding inside them.

mod common;

use common::*;
use moat_port::protocol::map;
use moat_port::term::Term;

fn step(op: &str, ins: &[u64], outs: &[u64], attrs: Term) -> Term {
    Term::tuple(vec![Term::atom(op), ids(ins), ids(outs), attrs])
}

fn program(id: u64, slots: u64, inputs: &[u64], outputs: &[u64], steps: Vec<Term>) -> Term {
    map(vec![
        ("id", Term::int(id)),
        ("slots", Term::int(slots)),
        ("inputs", ids(inputs)),
        ("outputs", ids(outputs)),
        ("steps", Term::List(steps)),
    ])
}

/// Sends a call and returns its reply header.
fn call(w: &mut Worker, seq: u64, op: &str, attrs: Term) -> Term {
    w.request(seq, op, &[], &[], attrs);
    w.recv().0
}

fn assert_ok(reply: &Term) {
    assert_eq!(reply.as_tuple().and_then(|t| t[0].as_atom()), Some("ok"), "{reply}");
}

fn f32_scalar(v: f32) -> Term {
    map(vec![
        ("shape", Term::nil()),
        ("type", ty("f", 32)),
        ("value", Term::Binary(v.to_le_bytes().to_vec())),
    ])
}

#[test]
fn a_program_is_defined_once_and_replayed() {
    let mut w = Worker::start(&[]);
    let steps = vec![
        step("multiply", &[0, 0], &[1], typed("f", 32)),
        step("add", &[1, 0], &[2], typed("f", 32)),
    ];
    assert_ok(&call(&mut w, 1, "define_program", program(7, 3, &[0], &[2], steps)));
    w.upload_f32(1, &[3], &[1.0, 2.0, 3.0]);
    w.upload_f32(2, &[2], &[-1.0, 0.5]);
    w.request(0, "run_program", &[10], &[1], Term::int(7));
    w.request(0, "run_program", &[11], &[2], Term::int(7));
    assert_eq!(w.read_f32(2, 10), vec![2.0, 6.0, 12.0]);
    assert_eq!(w.read_f32(3, 11), vec![0.0, 0.75]);

    // An id already defined is refused, and so is a second definition.
    let reply = call(&mut w, 4, "define_program", program(7, 1, &[0], &[0], vec![]));
    assert!(
        error_parts(&reply).1.contains("program 7 is already defined"),
        "{reply}"
    );

    // Released, a program is unknown: its outputs are poisoned.
    w.request(0, "release_program", &[], &[], ids(&[7]));
    w.request(0, "run_program", &[12], &[1], Term::int(7));
    let (op, message) = error_parts(&w.read(5, 12).unwrap_err());
    assert_eq!(op, "run_program");
    assert!(message.contains("program 7 is not defined"), "{message}");
}

#[test]
fn bad_programs_are_refused_when_defined() {
    let mut w = Worker::start(&[]);
    let cases = [
        (
            program(1, 2, &[0], &[1], vec![step("frobnicate", &[0], &[1], nil())]),
            "unknown op frobnicate",
        ),
        (
            program(1, 2, &[0], &[1], vec![step("add", &[0], &[1], nil())]),
            "add takes 2 inputs, got 1",
        ),
        (program(1, 2, &[0], &[5], vec![]), "bad slot 5"),
        (program(1, 1 << 40, &[0], &[0], vec![]), "slots must be an integer"),
        (map(vec![("id", Term::int(1))]), "missing attribute slots"),
    ];
    for (seq, (attrs, expected)) in cases.into_iter().enumerate() {
        let reply = call(&mut w, seq as u64 + 1, "define_program", attrs);
        let (op, message) = error_parts(&reply);
        assert_eq!(op, "define_program");
        assert!(message.contains(expected), "{message}");
    }
    // Counts that do not match the program poison the outputs.
    assert_ok(&call(&mut w, 9, "define_program", program(2, 1, &[0], &[0], vec![])));
    w.upload_f32(1, &[1], &[1.0]);
    w.request(0, "run_program", &[3], &[1, 1], Term::int(2));
    let (_, message) = error_parts(&w.read(10, 3).unwrap_err());
    assert!(message.contains("takes 1 inputs and gives 1 outputs"), "{message}");
}

/// `while {i = 0, acc = x}, i < n, do: {i + 1, acc * 2}`, then `acc`.
fn doubling_loop(id: u64) -> Term {
    doubling_loop_then(id, None)
}

/// `doubling_loop`, its body ending with `last` when there is one.
fn doubling_loop_then(id: u64, last: Option<Term>) -> Term {
    let s32 = |v: i32| {
        map(vec![
            ("shape", Term::nil()),
            ("type", ty("s", 32)),
            ("value", Term::Binary(v.to_le_bytes().to_vec())),
        ])
    };
    let less = map(vec![("input_type", ty("s", 32)), ("type", ty("u", 8))]);
    let body = map(vec![
        ("state", ids(&[3, 4])),
        ("cond", Term::List(vec![step("less", &[3, 1], &[5], less)])),
        ("pred", Term::int(5)),
        (
            "body",
            Term::List(
                [
                    step("constant", &[], &[6], s32(1)),
                    step("add", &[3, 6], &[7], typed("s", 32)),
                    step("constant", &[], &[8], f32_scalar(2.0)),
                    step("multiply", &[4, 8], &[9], typed("f", 32)),
                ]
                .into_iter()
                .chain(last)
                .collect(),
            ),
        ),
        ("results", ids(&[7, 9])),
    ]);
    let steps = vec![
        step("constant", &[], &[2], s32(0)),
        step("while", &[2, 0], &[10, 11], body),
    ];
    program(id, 12, &[0, 1], &[11, 10], steps)
}

#[test]
fn while_loops_run_in_the_worker() {
    let mut w = Worker::start(&[]);
    assert_ok(&call(&mut w, 1, "define_program", doubling_loop(3)));
    w.upload_f32(1, &[2], &[1.0, -0.5]);
    w.upload(2, &[], "s", 32, &i32_bytes(&[10]));
    w.upload(3, &[], "s", 32, &i32_bytes(&[0]));
    w.request(0, "run_program", &[20, 21], &[1, 2], Term::int(3));
    w.request(0, "run_program", &[22, 23], &[1, 3], Term::int(3));
    assert_eq!(w.read_f32(2, 20), vec![1024.0, -512.0]);
    assert_eq!(i32_values(&w.read_bytes(3, 21)), vec![10]);
    // A loop whose condition is false at once leaves its state unchanged.
    assert_eq!(w.read_f32(4, 22), vec![1.0, -0.5]);
}

#[test]
fn a_fused_while_loop_gives_the_unfused_results() {
    let mut w = Worker::start(&[]);
    let fused = match doubling_loop(3) {
        Term::Map(mut pairs) => {
            pairs.push((Term::atom("fuse"), Term::atom("true")));
            Term::Map(pairs)
        }
        _ => unreachable!(),
    };
    assert_ok(&call(&mut w, 1, "define_program", fused));
    w.upload_f32(1, &[2], &[1.0, -0.5]);
    w.upload(2, &[], "s", 32, &i32_bytes(&[10]));
    w.request(0, "run_program", &[20, 21], &[1, 2], Term::int(3));
    assert_eq!(w.read_f32(2, 20), vec![1024.0, -512.0]);
    assert_eq!(i32_values(&w.read_bytes(3, 21)), vec![10]);
}

#[test]
fn cond_picks_its_branch_in_the_worker() {
    let mut w = Worker::start(&[]);
    // cond: sum(x) > 0 -> x * 10; true -> x - 10
    let sum = map(vec![
        ("axes", ints(&[0])),
        ("keep_axes", Term::atom("false")),
        ("type", ty("f", 32)),
    ]);
    let greater = map(vec![("input_type", ty("f", 32)), ("type", ty("u", 8))]);
    let clause = Term::tuple(vec![
        Term::List(vec![
            step("sum", &[0], &[1], sum),
            step("constant", &[], &[2], f32_scalar(0.0)),
            step("greater", &[1, 2], &[3], greater),
        ]),
        Term::int(3),
        Term::List(vec![
            step("constant", &[], &[4], f32_scalar(10.0)),
            step("multiply", &[0, 4], &[5], typed("f", 32)),
        ]),
        ids(&[5]),
    ]);
    let last = Term::tuple(vec![
        Term::List(vec![
            step("constant", &[], &[6], f32_scalar(10.0)),
            step("subtract", &[0, 6], &[7], typed("f", 32)),
        ]),
        ids(&[7]),
    ]);
    let attrs = map(vec![("clauses", Term::List(vec![clause])), ("last", last)]);
    let steps = vec![step("cond", &[], &[8], attrs)];
    assert_ok(&call(&mut w, 1, "define_program", program(4, 9, &[0], &[8], steps)));
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.upload_f32(2, &[2], &[-1.0, -2.0]);
    w.request(0, "run_program", &[10], &[1], Term::int(4));
    w.request(0, "run_program", &[11], &[2], Term::int(4));
    assert_eq!(w.read_f32(2, 10), vec![10.0, 20.0]);
    assert_eq!(w.read_f32(3, 11), vec![-11.0, -12.0]);
}

#[test]
fn a_failing_step_poisons_the_outputs_and_names_its_op() {
    let mut w = Worker::start(&[]);
    let steps = vec![
        step("gather", &[0, 1], &[2], map(vec![("axes", ints(&[0]))])),
        step("negate", &[2], &[3], typed("f", 32)),
    ];
    assert_ok(&call(&mut w, 1, "define_program", program(5, 4, &[0, 1], &[3], steps)));
    w.upload_f32(1, &[2], &[1.0, 2.0]);
    w.upload(2, &[2, 1], "s", 32, &i32_bytes(&[1, 1_000_000_000]));
    w.upload(3, &[2, 1], "s", 32, &i32_bytes(&[1, 0]));
    w.request(0, "run_program", &[10], &[1, 2], Term::int(5));
    let (op, message) = error_parts(&w.read(2, 10).unwrap_err());
    assert_eq!(op, "gather");
    assert!(message.contains("out of bounds"), "{message}");
    // The worker and the program carry on.
    w.request(0, "run_program", &[11], &[1, 3], Term::int(5));
    assert_eq!(w.read_f32(3, 11), vec![-2.0, -1.0]);
    // A poisoned input poisons the outputs with its own failure.
    w.request(0, "run_program", &[12], &[10, 3], Term::int(5));
    assert_eq!(error_parts(&w.read(4, 12).unwrap_err()).0, "gather");
}

#[test]
fn the_memory_limit_holds_inside_programs() {
    let mut w = Worker::start(&[]);
    w.request(1, "set_memory_limit", &[], &[], Term::int(1 << 20));
    w.recv();
    let broadcast = map(vec![("shape", ints(&[1 << 20])), ("axes", ints(&[]))]);
    let steps = vec![
        step("broadcast", &[0], &[1], broadcast),
        step("negate", &[1], &[2], typed("f", 32)),
    ];
    assert_ok(&call(&mut w, 2, "define_program", program(6, 3, &[0], &[2], steps)));
    w.upload_f32(1, &[], &[1.0]);
    w.request(0, "run_program", &[10], &[1], Term::int(6));
    let (op, message) = error_parts(&w.read(3, 10).unwrap_err());
    assert_eq!(op, "negate");
    assert!(message.contains("memory limit exceeded"), "{message}");
}

#[test]
fn a_fused_program_gives_the_unfused_results() {
    let mut w = Worker::start(&[]);
    let steps = || {
        vec![
            step("multiply", &[0, 0], &[1], typed("f", 32)),
            step("constant", &[], &[2], f32_scalar(0.5)),
            step("multiply", &[1, 2], &[3], typed("f", 32)),
            step("exp", &[3], &[4], typed("f", 32)),
            step("add", &[4, 0], &[5], typed("f", 32)),
        ]
    };
    let with_fuse = |id: u64, fuse: bool| match program(id, 6, &[0], &[5], steps()) {
        Term::Map(mut pairs) => {
            pairs.push((Term::atom("fuse"), Term::atom(if fuse { "true" } else { "false" })));
            Term::Map(pairs)
        }
        _ => unreachable!(),
    };
    assert_ok(&call(&mut w, 1, "define_program", with_fuse(1, false)));
    assert_ok(&call(&mut w, 2, "define_program", with_fuse(2, true)));
    w.upload_f32(1, &[3], &[0.5, -1.0, 2.0]);
    for (k, id) in [10, 11, 12].into_iter().enumerate() {
        w.request(0, "run_program", &[id], &[1], Term::int(if k == 0 { 1 } else { 2 }));
    }
    let unfused = w.read_bytes(3, 10);
    assert_eq!(w.read_bytes(4, 11), unfused);
    // The second run replays the fused trace.
    assert_eq!(w.read_bytes(5, 12), unfused);
}

/// `doubling_loop` with a hook step on each iteration's new `acc` and `i`.
fn hooked(id: u64) -> Term {
    doubling_loop_then(id, Some(step("hook", &[9, 7], &[], map(vec![("id", Term::int(4))]))))
}

/// The next frame, which must be value `value` of a firing of hook 4 of run `seq`.
fn hook_frame(w: &mut Worker, seq: u64, value: u64) -> Vec<u8> {
    let (header, payload) = w.recv();
    let parts = header.as_tuple().unwrap_or_else(|| panic!("{header}"));
    assert!(
        parts[0].is_atom("hook") && parts[1].as_int() == Some(seq as _),
        "{header}"
    );
    let info = &parts[2];
    assert_eq!(info.get("id").and_then(Term::as_int), Some(4), "{header}");
    assert_eq!(info.get("value").and_then(Term::as_int), Some(value as _), "{header}");
    assert_eq!(info.get("of").and_then(Term::as_int), Some(2), "{header}");
    payload
}

#[test]
fn hook_steps_send_each_firing_to_the_caller_within_a_window() {
    let mut w = Worker::start(&[]);
    assert_ok(&call(&mut w, 1, "define_program", hooked(3)));
    w.upload_f32(1, &[2], &[1.0, -0.5]);
    w.upload(2, &[], "s", 32, &i32_bytes(&[80]));

    // Fire-and-forget, nobody would receive the values: the run fails.
    w.request(0, "run_program", &[20, 21], &[1, 2], Term::int(3));
    let (op, message) = error_parts(&w.read(2, 20).unwrap_err());
    assert_eq!(op, "hook");
    assert!(message.contains("runs as a call"), "{message}");

    // As a call: 80 firings, in order, each acc then i, acknowledged every
    // 16; a sync sent meanwhile is answered after the run.
    w.request(3, "run_program", &[22, 23], &[1, 2], Term::int(3));
    w.request(4, "sync", &[], &[], nil());
    for k in 1..=80u32 {
        let acc = hook_frame(&mut w, 3, 0);
        assert_eq!(acc, f32_bytes(&[2f32.powi(k as i32), -0.5 * 2f32.powi(k as i32)]));
        assert_eq!(i32_values(&hook_frame(&mut w, 3, 1)), vec![k as i32]);
        if k % 16 == 0 {
            let ack = map(vec![("run", Term::int(3)), ("received", Term::int(k as u64))]);
            w.request(0, "hook_ack", &[], &[], ack);
        }
    }
    assert_ok(&w.recv().0);
    assert_ok(&w.recv().0);
    assert_eq!(i32_values(&w.read_bytes(5, 23)), vec![80]);

    // A caller that stops acknowledging gets at most 32 firings; a cancel
    // ends the run with op `hook`, and the worker serves what comes next.
    w.upload(3, &[], "s", 32, &i32_bytes(&[1_000_000]));
    w.request(6, "run_program", &[24, 25], &[1, 3], Term::int(3));
    for _ in 0..32 {
        hook_frame(&mut w, 6, 0);
        hook_frame(&mut w, 6, 1);
    }
    w.request(
        0,
        "hook_ack",
        &[],
        &[],
        map(vec![("run", Term::int(6)), ("cancel", Term::atom("true"))]),
    );
    let (op, message) = error_parts(&w.recv().0);
    assert_eq!(op, "hook");
    assert!(message.contains("stopped the run"), "{message}");
    assert_ok(&call(&mut w, 7, "sync", nil()));
    assert_eq!(w.read(8, 24).unwrap_err().as_tuple().map(|t| t.len()), Some(4));
}

/// `x * x + x`, with `fuse: true`.
fn fused_chain(id: u64) -> Term {
    let steps = vec![
        step("multiply", &[0, 0], &[1], typed("f", 32)),
        step("add", &[1, 0], &[2], typed("f", 32)),
    ];
    let Term::Map(mut pairs) = program(id, 3, &[0], &[2], steps) else {
        unreachable!()
    };
    pairs.push((Term::atom("fuse"), Term::atom("true")));
    Term::Map(pairs)
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("moat-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn files_under(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .map(|e| if e.path().is_dir() { files_under(&e.path()) } else { 1 })
            .sum()
    })
}

#[test]
fn without_a_cpp_compiler_fused_programs_run_unfused_with_a_warning() {
    let kernels = scratch_dir("no-compiler");
    let env = [("PATH", "/nonexistent"), ("TMPDIR", kernels.to_str().unwrap())];
    let mut w = Worker::spawn(&[], &env, std::process::Stdio::piped());
    let _hello = w.recv();
    let mut log = w.child.stderr.take().unwrap();
    assert_ok(&call(&mut w, 1, "define_program", fused_chain(5)));
    let Term::Map(mut pairs) = doubling_loop(6) else {
        unreachable!()
    };
    pairs.push((Term::atom("fuse"), Term::atom("true")));
    assert_ok(&call(&mut w, 2, "define_program", Term::Map(pairs)));
    w.upload_f32(1, &[3], &[1.0, 2.0, -3.0]);
    w.upload(2, &[], "s", 32, &i32_bytes(&[10]));
    w.request(0, "run_program", &[20], &[1], Term::int(5));
    w.request(0, "run_program", &[21, 22], &[1, 2], Term::int(6));
    assert_eq!(w.read_f32(3, 20), vec![2.0, 6.0, 6.0]);
    assert_eq!(w.read_f32(4, 21), vec![1024.0, 2048.0, -3072.0]);
    assert!(w.close(std::time::Duration::from_secs(10)).success());
    let mut text = String::new();
    std::io::Read::read_to_string(&mut log, &mut text).unwrap();
    assert!(text.contains("no C++ compiler (g++) for MLX's fused kernels"), "{text}");
    assert_eq!(files_under(&kernels), 0, "nothing was compiled");
    let _ = std::fs::remove_dir_all(&kernels);
}

#[test]
fn fused_kernels_are_compiled_into_the_workers_tmpdir() {
    // Moat.Worker sets TMPDIR to its kernel cache (`config :moat,
    // kernel_cache`); MLX writes and builds its kernels there.
    let kernels = scratch_dir("kernel-cache");
    let mut w = Worker::start_env(&[], &[("TMPDIR", kernels.to_str().unwrap())]);
    assert_ok(&call(&mut w, 1, "define_program", fused_chain(5)));
    w.upload_f32(1, &[3], &[1.0, 2.0, -3.0]);
    w.request(0, "run_program", &[20], &[1], Term::int(5));
    assert_eq!(w.read_f32(2, 20), vec![2.0, 6.0, 6.0]);
    assert!(files_under(&kernels) > 0, "no kernel under {kernels:?}");
    let _ = std::fs::remove_dir_all(&kernels);
}
