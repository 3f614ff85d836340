//! A real worker process driven through real frames on fds 3 and 4, the way
//! the BEAM drives it.

#![allow(dead_code)]

pub mod report;

use command_fds::{CommandFdExt, FdMapping};
use moat_port::frame::{split_body, write_frame};
use moat_port::term::Term;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Worker {
    pub child: Child,
    to: std::fs::File,
    from: std::fs::File,
    pub generation: u64,
    /// The worker's first frame.
    pub hello: Term,
}

pub fn pipe() -> (OwnedFd, OwnedFd) {
    let (r, w) = std::io::pipe().expect("pipe");
    (r.into(), w.into())
}

fn wait_for(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(Instant::now() < deadline, "worker still running after {within:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl Worker {
    pub fn start(extra: &[&str]) -> Worker {
        Worker::start_with(extra, Stdio::inherit())
    }

    /// `start`, with the worker's stderr (its log) going to `stderr`.
    pub fn start_with(extra: &[&str], stderr: Stdio) -> Worker {
        let mut w = Worker::spawn(extra, &[], stderr);
        let (hello, _) = w.recv();
        assert!(
            matches!(hello.as_tuple(), Some([h, _, _]) if h.is_atom("hello")),
            "first frame: {hello}"
        );
        w.hello = hello;
        w
    }

    /// `start` with extra environment variables.
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Worker {
        let mut w = Worker::spawn(extra, env, Stdio::inherit());
        let (hello, _) = w.recv();
        w.hello = hello;
        w
    }

    /// The worker process, its hello not yet read.
    pub fn spawn(extra: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Worker {
        let (req_r, req_w) = pipe();
        let (rep_r, rep_w) = pipe();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_moat_port"));
        cmd.args(["--generation", "3"])
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stderr(stderr);
        cmd.fd_mappings(vec![
            FdMapping {
                parent_fd: req_r,
                child_fd: 3,
            },
            FdMapping {
                parent_fd: rep_w,
                child_fd: 4,
            },
        ])
        .expect("fd mappings");
        let child = cmd.spawn().expect("spawn moat_port");
        Worker {
            child,
            to: req_w.into(),
            from: rep_r.into(),
            generation: 3,
            hello: Term::atom("nil"),
        }
    }

    pub fn send(&mut self, header: Term, payload: &[u8]) {
        write_frame(&mut self.to, &header, payload).expect("write frame");
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.to.write_all(bytes).expect("write raw");
    }

    /// The next frame that is not an ack or a memory pressure report.
    pub fn recv(&mut self) -> (Term, Vec<u8>) {
        self.try_recv().expect("the worker closed its output")
    }

    /// The next frame that is not an ack, or `None` once the worker's output
    /// is closed (it exited).
    pub fn try_recv(&mut self) -> Option<(Term, Vec<u8>)> {
        loop {
            let mut len = [0u8; 4];
            if let Err(e) = self.from.read_exact(&mut len) {
                assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "read packet length: {e}");
                return None;
            }
            let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
            self.from.read_exact(&mut body).expect("read packet");
            let (header, payload) = split_body(&body).expect("worker frame");
            if matches!(header.as_tuple(), Some([a, _]) if a.is_atom("ack") || a.is_atom("memory_pressure")) {
                continue;
            }
            return Some((header, payload.to_vec()));
        }
    }

    /// Waits for the worker to exit on its own.
    pub fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        wait_for(&mut self.child, within)
    }

    pub fn request(&mut self, seq: u64, op: &str, outs: &[u64], ins: &[u64], attrs: Term) {
        let header = request(seq, self.generation, op, outs, ins, attrs);
        self.send(header, &[]);
    }

    /// `from_binary` of `bytes` as tensor `id` of type `{kind, bits}`.
    pub fn upload(&mut self, id: u64, shape: &[i32], kind: &str, bits: u32, bytes: &[u8]) {
        let header = request(
            0,
            self.generation,
            "from_binary",
            &[id],
            &[],
            tensor_attrs(shape, kind, bits, bytes.len()),
        );
        self.send(header, bytes);
    }

    pub fn upload_f32(&mut self, id: u64, shape: &[i32], values: &[f32]) {
        self.upload(id, shape, "f", 32, &f32_bytes(values));
    }

    /// `to_binary` of `id`: the concatenated payload, or the error tuple.
    pub fn read(&mut self, seq: u64, id: u64) -> Result<(Term, Vec<u8>), Term> {
        self.request(seq, "to_binary", &[], &[id], nil());
        let mut data = Vec::new();
        loop {
            let (header, payload) = self.recv();
            let items = header.as_tuple().expect("reply tuple").to_vec();
            assert_eq!(items[1], Term::int(seq), "reply routed to seq {seq}: {header}");
            match items[0].as_atom() {
                Some("more") => data.extend(payload),
                Some("ok") => {
                    data.extend(payload);
                    return Ok((items[2].clone(), data));
                }
                _ => return Err(header),
            }
        }
    }

    /// `to_binary` of `id`, which must succeed.
    pub fn read_bytes(&mut self, seq: u64, id: u64) -> Vec<u8> {
        self.read(seq, id).unwrap_or_else(|e| panic!("to_binary failed: {e}")).1
    }

    pub fn read_f32(&mut self, seq: u64, id: u64) -> Vec<f32> {
        self.read_bytes(seq, id)
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Closes the worker's input and waits for it to exit.
    pub fn close(self, within: Duration) -> std::process::ExitStatus {
        let Worker { mut child, to, .. } = self;
        drop(to);
        wait_for(&mut child, within)
    }

    /// Whether the worker runs its ops on a GPU (the hello's `device`: the
    /// CUDA build where it sees one).
    pub fn on_gpu(&self) -> bool {
        matches!(self.hello.as_tuple(), Some([_, _, info]) if info.get("device") == Some(&Term::atom("gpu")))
    }

    /// True, after saying why on stderr, when the worker runs on a GPU: the
    /// caller returns early (a test of what holds on the CPU only).
    pub fn skip_on_gpu(&self, test: &str, why: &str) -> bool {
        if self.on_gpu() {
            eprintln!("{test}: skipped on the GPU worker: {why}");
        }
        self.on_gpu()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn input_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.to.as_fd()
    }
}

pub fn nil() -> Term {
    Term::atom("nil")
}

/// The Nx type `{kind, bits}`.
pub fn ty(kind: &str, bits: u32) -> Term {
    Term::tuple(vec![Term::atom(kind), Term::int(bits)])
}

/// `%{type: {kind, bits}}`: the attrs of most graph ops.
pub fn typed(kind: &str, bits: u32) -> Term {
    moat_port::protocol::map(vec![("type", ty(kind, bits))])
}

pub fn ids(v: &[u64]) -> Term {
    Term::List(v.iter().map(|i| Term::int(*i)).collect())
}

pub fn ints(v: &[i64]) -> Term {
    Term::List(v.iter().map(|i| Term::int(*i)).collect())
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i32_values(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn request(seq: u64, generation: u64, op: &str, outs: &[u64], ins: &[u64], attrs: Term) -> Term {
    Term::tuple(vec![
        Term::int(seq),
        Term::int(generation),
        Term::atom(op),
        ids(outs),
        ids(ins),
        attrs,
    ])
}

pub fn tensor_attrs(shape: &[i32], kind: &str, bits: u32, bytes: usize) -> Term {
    moat_port::protocol::map(vec![
        ("bytes", Term::int(bytes as u64)),
        ("dtype", ty(kind, bits)),
        ("shape", moat_port::protocol::shape_term(shape)),
    ])
}

/// `{:error, seq, op, %{kind: kind, message: message, ...}}` → (op, message).
pub fn error_parts(t: &Term) -> (String, String) {
    match t.as_tuple() {
        Some([tag, _, op, failure]) if tag.is_atom("error") => match failure.get("message") {
            Some(Term::Binary(m)) => (
                op.as_atom().unwrap().to_string(),
                String::from_utf8_lossy(m).into_owned(),
            ),
            _ => panic!("an error reply without a message: {t}"),
        },
        _ => panic!("not an error reply: {t}"),
    }
}

/// The `kind` of an error reply's failure.
pub fn error_kind(t: &Term) -> String {
    match t.as_tuple() {
        Some([tag, _, _, failure]) if tag.is_atom("error") => {
            failure.get("kind").and_then(Term::as_atom).expect("a kind").to_string()
        }
        _ => panic!("not an error reply: {t}"),
    }
}
