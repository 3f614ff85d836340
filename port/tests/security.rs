//! What the worker touches: only the descriptors it was given, no sockets, no
//! child process but its input holder, nothing run but its op table, and no
//! tensor data in its log.

mod common;

use common::*;
use moat_port::term::Term;
use std::process::Stdio;
use std::time::Duration;

/// fd number → what it points at (`pipe:[..]`, `socket:[..]`, a path).
fn open_fds(pid: u32) -> Vec<(u32, String)> {
    let mut fds: Vec<(u32, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/<pid>/fd")
        .filter_map(|e| {
            let e = e.ok()?;
            let fd = e.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(e.path()).ok()?;
            Some((fd, target.to_string_lossy().into_owned()))
        })
        .collect();
    fds.sort();
    fds
}

fn children(pid: u32) -> Vec<u32> {
    let mut all = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let list = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        all.extend(list.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
    }
    all
}

/// The worker's only child is the input holder (see `sys::hold_input_open`):
/// it holds the request pipe and nothing else. Returns its pid.
fn only_the_input_holder(w: &Worker) -> u32 {
    let kids = children(w.pid());
    assert_eq!(
        kids.len(),
        1,
        "the worker has children other than its input holder: {kids:?}"
    );
    let holder = kids[0];
    let worker_input = open_fds(w.pid()).into_iter().find(|(fd, _)| *fd == 3).unwrap().1;
    // The forked holder renames itself and closes what it inherited as soon
    // as it is first scheduled, which on a loaded machine can take a while.
    let comm = || std::fs::read_to_string(format!("/proc/{holder}/comm")).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while (comm().trim() != "moat_port-hold" || open_fds(holder).len() > 1) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(comm().trim(), "moat_port-hold");
    assert_eq!(
        open_fds(holder),
        vec![(3, worker_input)],
        "the holder holds more than the request pipe"
    );
    holder
}

/// Held while a test starts a worker, and while one lists the descriptors a
/// worker could inherit: a spawn in progress in another test briefly holds
/// descriptors a child would inherit.
static SPAWN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn start(extra: &[&str], stderr: Stdio) -> Worker {
    let _spawning = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
    Worker::start_with(extra, stderr)
}

fn zombie(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(") ").next().is_some_and(|rest| rest.starts_with('Z'))
}

/// Uploads, computes and reads back enough to wake every thread MLX and BLAS start.
fn exercise(w: &mut Worker) {
    let n = 128;
    w.upload_f32(1, &[n, n], &vec![0.5; (n * n) as usize]);
    w.request(0, "matmul", &[2], &[1, 1], typed("f", 32));
    w.request(
        0,
        "sum",
        &[3],
        &[2],
        moat_port::protocol::map(vec![("axes", ids(&[0, 1])), ("keep_axes", Term::atom("false"))]),
    );
    let (_, bytes) = w.read(1, 3).unwrap();
    assert_eq!(
        f32::from_le_bytes(bytes[..4].try_into().unwrap()),
        0.25 * 128.0 * 128.0 * 128.0
    );
}

/// Descriptors of this test process that a child inherits (no close-on-exec),
/// such as cargo's jobserver pipe. The BEAM closes those before it starts a
/// port; this harness does not.
fn inheritable_fds() -> Vec<u32> {
    open_fds(std::process::id())
        .into_iter()
        .map(|(fd, _)| fd)
        .filter(|fd| {
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap_or_default();
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .map(str::trim)
                .unwrap_or("0");
            u32::from_str_radix(flags, 8).is_ok_and(|f| f & libc::O_CLOEXEC as u32 == 0)
        })
        .filter(|fd| *fd > 4)
        .collect()
}

#[test]
fn the_worker_holds_only_the_descriptors_it_was_given_and_no_sockets() {
    let mut w = start(&[], Stdio::inherit());
    exercise(&mut w);
    let fds = open_fds(w.pid());
    let mut expected = vec![0, 1, 2, 3, 4];
    expected.extend({
        let _spawning = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
        inheritable_fds()
    });
    expected.sort();
    // On a GPU the CUDA driver opens its own: its devices, eventfds, pipes
    // and a socket, after the ones given. The rest holds as on the CPU.
    let driver = |(fd, t): &&(u32, String)| {
        w.on_gpu()
            && !expected.contains(fd)
            && ["/dev/nvidia", "anon_inode:", "pipe:", "socket:"]
                .iter()
                .any(|p| t.starts_with(p))
    };
    if w.on_gpu() {
        let opened = fds.iter().filter(driver).count();
        eprintln!("the worker holds {opened} descriptors of the CUDA driver (not checked)");
    }
    // The session's spin keeps `/proc/loadavg` open to tell an idle machine
    // from a loaded one (port/src/spin.rs), and the reader waits on a timer
    // (port/src/input.rs): each one of its own, close-on-exec.
    let own = |t: &str| t == "/proc/loadavg" || t == "anon_inode:[timerfd]";
    let fds: Vec<(u32, String)> = fds.iter().filter(|f| !driver(f) && !own(&f.1)).cloned().collect();
    let numbers: Vec<u32> = fds.iter().map(|(fd, _)| *fd).collect();
    assert_eq!(numbers, expected, "unexpected descriptors: {fds:?}");
    assert!(
        fds[3].1.starts_with("pipe:") && fds[4].1.starts_with("pipe:"),
        "fds 3 and 4 must be the pipes: {fds:?}"
    );
    assert!(
        fds.iter().all(|(_, t)| !t.starts_with("socket:")),
        "a socket is open: {fds:?}"
    );
    let holder = only_the_input_holder(&w);
    w.close(Duration::from_secs(1));
    // The holder leaves once the client has closed the pipe.
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while std::path::Path::new(&format!("/proc/{holder}/comm")).exists() && !zombie(holder) {
        assert!(
            std::time::Instant::now() < deadline,
            "the input holder outlived its client"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn nothing_outside_the_op_table_runs() {
    let mut w = start(&["--log-level", "error"], Stdio::null());
    // The production build has no :fault op; names that would mean something
    // to a shell or a loader are just unknown ops.
    for (seq, op) in [
        "fault",
        "system",
        "exec",
        "/bin/sh",
        "../../../bin/true",
        "dlopen",
        "eval_string",
    ]
    .iter()
    .enumerate()
    {
        let seq = seq as u64 + 1;
        let attrs = moat_port::protocol::map(vec![
            ("kind", Term::atom("sigkill")),
            ("cmd", Term::Binary(b"touch /tmp/moat-pwned".to_vec())),
        ]);
        w.request(seq, op, &[], &[], attrs);
        let (failed, message) = error_parts(&w.recv().0);
        assert_eq!((failed.as_str(), message), (*op, format!("unknown op {op}")));
    }
    assert!(!std::path::Path::new("/tmp/moat-pwned").exists());
    only_the_input_holder(&w);
    exercise(&mut w);
    assert!(w.close(Duration::from_secs(1)).success());
}

#[test]
fn tensor_data_never_reaches_the_log_even_at_trace_level() {
    let log = std::env::temp_dir().join(format!("moat-security-{}.log", std::process::id()));
    let file = std::fs::File::create(&log).unwrap();
    let mut w = start(
        &["--log-level", "trace", "--max-frame-bytes", "4096"],
        Stdio::from(file),
    );
    let secret = b"SECRET-TENSOR-BYTES-0123456789ab";
    let attrs = |n: usize| tensor_attrs(&[n as i32], "u", 8, n);
    // Accepted, computed on, failed on, refused and read back.
    w.send(request(0, 3, "from_binary", &[1], &[], attrs(secret.len())), secret);
    w.request(
        0,
        "reshape",
        &[2],
        &[1],
        moat_port::protocol::map(vec![("shape", ids(&[7, 7]))]),
    );
    assert!(w.read(1, 2).is_err());
    w.send(request(0, 3, "from_binary", &[3], &[], attrs(secret.len() - 1)), secret);
    let big: Vec<u8> = secret.iter().copied().cycle().take(8192).collect();
    w.send(request(0, 3, "from_binary", &[4], &[], attrs(big.len())), &big);
    w.send(request(0, 3, "add", &[5], &[1, 1], typed("u", 8)), secret);
    for op in ["from_binary", "protocol", "add"] {
        assert_eq!(error_parts(&w.recv().0).0, op);
    }
    assert_eq!(w.read(2, 1).unwrap().1, secret);
    w.close(Duration::from_secs(1));
    let text = std::fs::read(&log).unwrap();
    std::fs::remove_file(&log).ok();
    assert!(text.len() > 100, "the worker logged nothing at trace level");
    let leaked = text.windows(8).any(|w| secret.windows(8).any(|s| s == w));
    assert!(
        !leaked,
        "tensor bytes appear in the log:\n{}",
        String::from_utf8_lossy(&text)
    );
}
