//! Synchronous CPU evaluations run MLX's tasks on the calling thread
//! (port/shim/scheduler.cpp), and keep MLX's behaviour where a kernel
//! throws: the evaluation fails with the kernel's message, MLX's count of
//! active tasks comes back to zero, the stream's error is cleared by the
//! evaluation that reports it, and one left by an async evaluation is
//! reported by the next synchronous one, as MLX does. Run with
//! MOAT_INLINE_EVAL=0 it checks that everything is forwarded instead.
//!
//! In process, through the library: one test function, since MLX's CPU
//! stream is shared by the process and the steps depend on their order.

use moat_port::mlx::{self, ops, Array, InlineStats};

fn f32s(values: &[f32]) -> Array {
    Array::from_values(values, &[values.len() as i32]).unwrap()
}

fn read(a: &Array) -> Vec<f32> {
    a.evaluate().unwrap().values::<f32>().unwrap().to_vec()
}

/// A lower-triangular system MLX fails when it evaluates (a zero pivot).
fn singular() -> Array {
    let a = Array::from_values(&[0.0f32, 0.0, 1.0, 1.0], &[2, 2]).unwrap();
    ops::solve_triangular(&a, &f32s(&[4.0, 2.0]), false).unwrap()
}

/// A chain of `n` adds of one to `x`: more than one of MLX's task groups
/// (ten kernels each) once `n` > 10.
fn chain(x: &Array, n: usize) -> Array {
    let one = f32s(&[1.0; 4]);
    let mut acc = ops::add(x, &one).unwrap();
    for _ in 1..n {
        acc = ops::add(&acc, &one).unwrap();
    }
    acc
}

/// MLX's count of active task groups once the stream's thread has run what
/// it holds (waits at most 1 s for it to fall). MLX itself leaves one counted
/// when it reports a stream's error as a task group is queued (its CPU
/// encoder counts the group before `enqueue` throws, and the group's
/// completion task is never queued), with or without inlining.
fn settle() -> i64 {
    let start = std::time::Instant::now();
    let mut active = mlx::inline_eval_stats().active;
    while active != 0 && start.elapsed().as_millis() < 1000 {
        std::thread::sleep(std::time::Duration::from_millis(1));
        active = mlx::inline_eval_stats().active;
    }
    active
}

fn since(before: InlineStats) -> (u64, u64) {
    let now = mlx::inline_eval_stats();
    (now.inlined - before.inlined, now.forwarded - before.forwarded)
}

#[test]
fn synchronous_cpu_evaluations_run_inline_and_keep_mlx_errors() {
    // Inlining is the CPU stream's; a CUDA build's default device is the GPU.
    mlx::Device::Cpu.make_default().unwrap();
    let inline = mlx::inline_eval();
    assert_eq!(inline, std::env::var("MOAT_INLINE_EVAL").as_deref() != Ok("0"));
    let x = f32s(&[1.0, 2.0, 3.0, 4.0]);

    // The first evaluation of a stream is forwarded: its success is what
    // shows the stream holds no error.
    mlx::eval(&[&chain(&x, 2)]).unwrap();

    // A small chain: every task (25 kernels, three task groups, the final
    // signal) on this thread, none on the stream's.
    let before = mlx::inline_eval_stats();
    let y = chain(&x, 25);
    mlx::eval(&[&y]).unwrap();
    let (inlined, forwarded) = since(before);
    if inline {
        assert!(
            inlined >= 25 && forwarded == 0,
            "inlined {inlined}, forwarded {forwarded}"
        );
    } else {
        assert!(
            inlined == 0 && forwarded >= 25,
            "inlined {inlined}, forwarded {forwarded}"
        );
    }
    assert_eq!(mlx::inline_eval_stats().active, 0);
    assert_eq!(read(&y), vec![26.0, 27.0, 28.0, 29.0]);

    // A kernel that throws in the middle of an evaluation of many task
    // groups: the evaluation fails with its message, MLX's task count is
    // back to zero, and the next evaluations succeed (inline again).
    let bad = ops::add(&chain(&x, 15), &ops::sum(&singular(), &[0], false).unwrap()).unwrap();
    let bad = chain(&bad, 15);
    let err = mlx::eval(&[&bad]).unwrap_err();
    assert!(err.message.contains("triangular inversion failed"), "{}", err.message);
    let base = settle();
    assert!(base <= 1, "{base} task groups left counted after one error");
    // Until the stream's thread has let go of the forwarded tasks, later
    // evaluations are forwarded too; then they run inline again.
    let mut inline_again = false;
    for _ in 0..50 {
        let before = mlx::inline_eval_stats();
        let z = chain(&x, 12);
        mlx::eval(&[&z]).unwrap();
        assert_eq!(read(&z), vec![13.0, 14.0, 15.0, 16.0]);
        let (inlined, forwarded) = since(before);
        if inlined > 0 && forwarded == 0 {
            inline_again = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(inline_again, inline, "inline again after an error");
    assert_eq!(mlx::inline_eval_stats().active, base);

    // A synchronous evaluation behind an async one still running on the
    // stream's thread: its tasks queue behind (forwarded), the result is
    // right.
    let long = chain(&x, 2000);
    mlx::async_eval(&[&long]).unwrap();
    let after = ops::add(&long, &x).unwrap();
    mlx::eval(&[&after]).unwrap();
    assert_eq!(read(&after), vec![2002.0, 2004.0, 2006.0, 2008.0]);
    assert_eq!(mlx::inline_eval_stats().active, base);

    // An error an async evaluation left in the stream is reported once: by
    // the async evaluation itself when MLX finds it there as the next task is
    // queued (this thread is MLX's main thread), or else by the next
    // synchronous evaluation on that stream (MLX poisons its event from the
    // stream's error), but not by the one after.
    let failed = singular();
    let queued = mlx::async_eval(&[&failed, &chain(&x, 40)]);
    match queued {
        Ok(()) => {
            // Until the stream's thread is done with it.
            while mlx::inline_eval_stats().active > base + 1 {
                std::thread::yield_now();
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            let unrelated = chain(&x, 3);
            let err = mlx::eval(&[&unrelated]).unwrap_err();
            assert!(err.message.contains("triangular inversion failed"), "{}", err.message);
        }
        Err(err) => {
            assert!(err.message.contains("triangular inversion failed"), "{}", err.message);
        }
    }
    let next = chain(&x, 3);
    mlx::eval(&[&next]).unwrap();
    assert_eq!(read(&next), vec![4.0, 5.0, 6.0, 7.0]);
    assert!(settle() <= base + 1);

    errors_in_a_row_leave_no_task_counted();
}

/// Errors an async evaluation leaves, each followed by a synchronous
/// evaluation, many times over: MLX's count of active task groups must not
/// creep up (at its limit, `wait_for_one` would block the worker for good),
/// and the next evaluation succeeds. Run on its own thread, so a hang fails
/// the test instead of stalling it.
fn errors_in_a_row_leave_no_task_counted() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let x = f32s(&[1.0, 2.0, 3.0, 4.0]);
        let mut worst = 0;
        for _ in 0..300 {
            let failing = ops::add(&chain(&x, 5), &ops::sum(&singular(), &[0], false).unwrap()).unwrap();
            let _ = mlx::async_eval(&[&chain(&failing, 25)]);
            let _ = mlx::eval(&[&chain(&x, 26)]);
            worst = worst.max(mlx::inline_eval_stats().active);
        }
        let y = chain(&x, 3);
        mlx::eval(&[&y]).unwrap();
        done.send((worst, read(&y))).unwrap();
    });
    let (worst, y) = finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("evaluations blocked after repeated errors");
    assert_eq!(y, vec![4.0, 5.0, 6.0, 7.0]);
    assert!(worst <= 2, "MLX's active task count crept up to {worst}");
}
