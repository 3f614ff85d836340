//! The reader and writer threads around the session.
//!
//! The reader turns frames into `Incoming` messages for the session thread;
//! it reads upload payloads straight into MLX-allocated buffers, so tensor
//! bytes are copied once, from the pipe into their final place. It also
//! serves shared-memory uploads (see `shared`): it makes the memory file and
//! answers at once, without waiting for the session, and maps the file once
//! the client has filled it. The writer owns the output pipe and splits
//! large readbacks into `chunk_bytes` frames.

use crate::budget::budget;
use crate::failure::Failure;
use crate::frame::{write_frame, FrameReader, Head, Limits};
use crate::mlx::{Array, Buffer, Dtype, Evaluated};
use crate::protocol::{self, Id, Malformed, Request, FROM_BINARY};
use crate::shared::{Mapped, Staged};
use crate::term::Term;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::sync::{Arc, Mutex};

pub enum Incoming {
    Request {
        req: Request,
        upload: Option<Upload>,
    },
    Malformed(Malformed),
    /// A frame the reader consumed itself (a middle chunk of an upload, or
    /// a shared file it made and answered).
    Consumed,
}

/// The complete bytes of an uploaded tensor.
pub enum Upload {
    /// Read from the pipe into MLX's memory.
    Piped {
        buffer: Buffer,
        shape: Vec<i32>,
        dtype: Dtype,
    },
    /// Written by the client into a shared file, mapped.
    Shared(Mapped),
}

impl Upload {
    pub fn into_array(self) -> crate::mlx::Result<Array> {
        match self {
            Upload::Piped { buffer, shape, dtype } => buffer.into_array(&shape, dtype),
            Upload::Shared(mapped) => mapped.into_array(),
        }
    }
}

pub enum Outgoing {
    Frame(Term),
    /// `{:ok, seq, result}` with the evaluated array's bytes as payload,
    /// preceded by `{:more, seq}` frames when they exceed one chunk.
    Data {
        seq: u64,
        result: Term,
        data: Evaluated,
    },
}

/// What the reader needs besides its input.
#[derive(Clone)]
pub struct ReaderConfig {
    pub limits: Limits,
    pub generation: u64,
    /// Whether shared-memory uploads are offered (see `shared::offer`).
    pub shared_memory: bool,
    /// Where the reader sends the replies it gives itself.
    pub replies: Replies,
}

/// A pipe upload whose chunks are still arriving.
struct Pending {
    req: Request,
    buffer: Buffer,
    shape: Vec<i32>,
    dtype: Dtype,
    filled: usize,
}

struct Reader<R> {
    frames: FrameReader<R>,
    config: ReaderConfig,
    uploads: HashMap<Id, Pending>,
    staged: HashMap<Id, Staged>,
}

/// Reads frames until end of input (`Ok`) or a broken stream (`Err`).
pub fn read_loop(input: impl Read, config: ReaderConfig, tx: Sender<Incoming>) -> io::Result<()> {
    // Small frames arrive many per read; payloads larger than the buffer
    // bypass it and land straight in their MLX buffer.
    let frames = FrameReader::new(BufReader::with_capacity(64 << 10, input), config.limits);
    let mut reader = Reader {
        frames,
        config,
        uploads: HashMap::new(),
        staged: HashMap::new(),
    };
    while let Some(head) = reader.frames.next_head()? {
        let msg = reader.incoming(head)?;
        if let Incoming::Request { req, .. } = &msg {
            crate::trace::stamp("R", req.seq);
        }
        if tx.send(msg).is_err() {
            break;
        }
    }
    Ok(())
}

impl<R: Read> Reader<R> {
    fn incoming(&mut self, head: Head) -> io::Result<Incoming> {
        let Head {
            header,
            payload_len,
            oversized,
        } = head;
        let parsed = header
            .map_err(|e| Malformed {
                seq: 0,
                outs: vec![],
                failure: Failure::protocol("protocol", e.to_string()),
            })
            .and_then(Request::parse);
        let req = match parsed {
            Ok(req) => req,
            Err(m) => {
                self.frames.skip_payload()?;
                return Ok(Incoming::Malformed(m));
            }
        };
        if oversized {
            let limits = self.config.limits;
            let message = format!(
                "frame of more than {} bytes refused (send large tensors in chunks of at most {} bytes)",
                limits.max_frame_bytes, limits.chunk_bytes
            );
            return self.refuse(req, Failure::protocol("protocol", message));
        }
        match req.op.as_str() {
            "from_binary" | "upload" if req.seq != 0 => {
                let message = format!("{} is fire-and-forget: send it with seq 0", req.op);
                let failure = Failure::protocol(&req.op, message);
                self.refuse(req, failure)
            }
            "from_binary" => self.start_upload(req, payload_len),
            "upload" => self.continue_upload(req, payload_len),
            _ if payload_len > 0 => {
                let message = format!("{} takes no payload, got {payload_len} bytes", req.op);
                let failure = Failure::protocol(&req.op, message);
                self.refuse(req, failure)
            }
            "upload_file" => self.stage(req),
            "from_file" => self.map_file(req),
            "release" => {
                // Uploads that never completed go with their ids: their
                // sender died between chunks, or before filling its file.
                for id in &req.ins {
                    self.uploads.remove(id);
                    self.staged.remove(id);
                }
                Ok(Incoming::Request { req, upload: None })
            }
            _ => Ok(Incoming::Request { req, upload: None }),
        }
    }

    /// Drops the frame's payload and any upload in progress for its ids; the
    /// session poisons them and answers a call.
    fn refuse(&mut self, req: Request, failure: Failure) -> io::Result<Incoming> {
        self.frames.skip_payload()?;
        for id in &req.outs {
            self.uploads.remove(id);
            self.staged.remove(id);
        }
        Ok(Incoming::Malformed(Malformed {
            seq: req.seq,
            outs: req.outs,
            failure,
        }))
    }

    fn start_upload(&mut self, req: Request, payload_len: usize) -> io::Result<Incoming> {
        let (shape, dtype, total) = match upload_attrs(&req) {
            Ok(v) => v,
            Err(message) => return self.refuse(req, Failure::invalid(FROM_BINARY, message)),
        };
        if payload_len > total {
            let message = format!("payload of {payload_len} bytes exceeds the tensor's {total} bytes");
            return self.refuse(req, Failure::invalid(FROM_BINARY, message));
        }
        if let Err(e) = budget().admit(total) {
            return self.refuse(req, Failure::memory_limit(FROM_BINARY, &e));
        }
        let mut buffer = match Buffer::alloc(total) {
            Ok(b) => b,
            Err(e) => return self.refuse(req, Failure::mlx(FROM_BINARY, e)),
        };
        self.frames.read_payload(&mut buffer.as_mut_slice()[..payload_len])?;
        Ok(self.finish_or_park(Pending {
            req,
            buffer,
            shape,
            dtype,
            filled: payload_len,
        }))
    }

    fn continue_upload(&mut self, req: Request, payload_len: usize) -> io::Result<Incoming> {
        let id = match req.outs.as_slice() {
            [id] if req.ins.is_empty() => *id,
            _ => {
                let failure = Failure::invalid("upload", "upload defines exactly one id and reads none");
                return self.refuse(req, failure);
            }
        };
        let Some(mut pending) = self.uploads.remove(&id) else {
            let failure = Failure::invalid("upload", format!("no upload in progress for tensor id {id}"));
            return self.refuse(req, failure);
        };
        let total = pending.buffer.len();
        let offset = req.attrs.as_int();
        if offset != Some(pending.filled as i128) || payload_len > total - pending.filled {
            let message = format!(
                "chunk at offset {} with {payload_len} bytes does not continue tensor {id} ({} of {total} bytes received)",
                req.attrs, pending.filled
            );
            return self.refuse(pending.req, Failure::invalid("upload", message));
        }
        let filled = pending.filled;
        self.frames
            .read_payload(&mut pending.buffer.as_mut_slice()[filled..filled + payload_len])?;
        pending.filled += payload_len;
        Ok(self.finish_or_park(pending))
    }

    fn finish_or_park(&mut self, pending: Pending) -> Incoming {
        if pending.filled == pending.buffer.len() {
            let Pending {
                req,
                buffer,
                shape,
                dtype,
                ..
            } = pending;
            return Incoming::Request {
                req,
                upload: Some(Upload::Piped { buffer, shape, dtype }),
            };
        }
        let id = pending.req.outs.first().copied().unwrap_or(0);
        self.uploads.insert(id, pending);
        Incoming::Consumed
    }

    /// `:upload_file`: makes the memory file for a tensor and answers with
    /// where it is.
    fn stage(&mut self, req: Request) -> io::Result<Incoming> {
        if !self.config.shared_memory {
            return self.refuse(
                req,
                Failure::invalid(FROM_BINARY, "shared memory is off in this worker"),
            );
        }
        if req.seq == 0 {
            let failure = Failure::protocol(FROM_BINARY, "upload_file is a call: send it with a seq");
            return self.refuse(req, failure);
        }
        if req.generation != self.config.generation {
            let failure = Failure::stale_generation(req.generation, self.config.generation, "upload_file");
            return self.refuse(req, failure);
        }
        let (shape, dtype, total) = match upload_attrs(&req) {
            Ok(v) => v,
            Err(message) => return self.refuse(req, Failure::invalid(FROM_BINARY, message)),
        };
        let id = req.outs[0];
        if self.staged.contains_key(&id) || self.uploads.contains_key(&id) {
            let failure = Failure::invalid(FROM_BINARY, format!("tensor id {id} is already being uploaded"));
            return self.refuse(req, failure);
        }
        let staged = match Staged::new(shape, dtype, total).and_then(|s| s.location().map(|at| (s, at))) {
            Ok(v) => v,
            Err(failure) => return self.refuse(req, failure),
        };
        let (staged, location) = staged;
        self.staged.insert(id, staged);
        self.config
            .replies
            .send(Outgoing::Frame(protocol::ok(req.seq, location)));
        Ok(Incoming::Consumed)
    }

    /// `:from_file`: the filled file becomes the tensor.
    fn map_file(&mut self, req: Request) -> io::Result<Incoming> {
        let id = match req.outs.as_slice() {
            [id] if req.ins.is_empty() => *id,
            _ => {
                let failure = Failure::invalid(FROM_BINARY, "from_file defines exactly one id and reads none");
                return self.refuse(req, failure);
            }
        };
        let Some(staged) = self.staged.remove(&id) else {
            let failure = Failure::invalid(
                FROM_BINARY,
                format!("no shared file for tensor id {id} (see upload_file)"),
            );
            return self.refuse(req, failure);
        };
        match staged.map() {
            Ok(mapped) => Ok(Incoming::Request {
                req,
                upload: Some(Upload::Shared(mapped)),
            }),
            Err(failure) => self.refuse(req, failure),
        }
    }
}

/// `%{shape: [..], dtype: type, bytes: total}`, checked against each other.
fn upload_attrs(req: &Request) -> Result<(Vec<i32>, Dtype, usize), String> {
    if req.outs.len() != 1 || !req.ins.is_empty() {
        return Err(format!("{} defines exactly one id and reads none", req.op));
    }
    let a = &req.attrs;
    let dims = a
        .get("shape")
        .and_then(Term::as_list)
        .ok_or("missing attribute shape")?;
    let shape: Vec<i32> = dims
        .iter()
        .map(|d| d.as_int().and_then(|d| i32::try_from(d).ok()).filter(|d| *d >= 0))
        .collect::<Option<_>>()
        .ok_or_else(|| {
            format!(
                "shape dimensions must be integers in 0..2^31, got {}",
                Term::List(dims.to_vec())
            )
        })?;
    let dtype = a
        .get("dtype")
        .and_then(protocol::dtype)
        .ok_or("missing or unsupported dtype")?;
    let total = a.get("bytes").and_then(Term::as_int).ok_or("missing attribute bytes")?;
    let expected = shape
        .iter()
        .try_fold(dtype.size() as u128, |acc, d| acc.checked_mul(*d as u128))
        .filter(|n| *n <= isize::MAX as u128)
        .ok_or("the shape's byte size overflows")?;
    if total as u128 != expected || total < 0 {
        return Err(format!("bytes is {total} but the shape and dtype need {expected}"));
    }
    Ok((shape, dtype, total as usize))
}

/// The way out of the worker. A small frame (a header, or a readback of at
/// most `INLINE_BYTES` that fits one chunk) is written at once by the thread
/// that has it when nothing is queued ahead of it, which saves a thread
/// wake-up per reply (docs/latency.md); anything else, large tensor data
/// above all, goes through the writer thread. Replies to different calls may
/// thus pass each other; the frames of one reply never do, and the client
/// takes acks as a maximum.
#[derive(Clone)]
pub struct Replies {
    queue: Sender<Outgoing>,
    sink: Sink,
    chunk_bytes: usize,
}

/// The largest readback the session thread writes itself: one buffer's worth,
/// so that a write never waits long on a reader slow to drain the pipe.
const INLINE_BYTES: usize = 64 << 10;

type Sink = Arc<Mutex<BufWriter<Box<dyn Write + Send>>>>;

impl Replies {
    /// The replies and the writer thread's queue, over `output`; readbacks
    /// go in frames of at most `chunk_bytes`.
    pub fn new(output: impl Write + Send + 'static, capacity: usize, chunk_bytes: usize) -> (Replies, Writer) {
        let (queue, rx) = bounded(capacity);
        let sink: Sink = Arc::new(Mutex::new(BufWriter::with_capacity(INLINE_BYTES, Box::new(output))));
        let chunk_bytes = chunk_bytes.max(1);
        (
            Replies {
                queue,
                sink: sink.clone(),
                chunk_bytes,
            },
            Writer { sink, rx, chunk_bytes },
        )
    }

    fn inline(&self, msg: &Outgoing) -> bool {
        match msg {
            Outgoing::Frame(_) => true,
            Outgoing::Data { data, .. } => data.bytes().len() <= INLINE_BYTES.min(self.chunk_bytes),
        }
    }

    /// Sends `msg`; a failed write means the client is gone, and the process
    /// exits (as the writer thread does).
    pub fn send(&self, msg: Outgoing) {
        let msg = if self.inline(&msg) && self.queue.is_empty() {
            match self.sink.try_lock() {
                Ok(mut w) if self.queue.is_empty() => {
                    if write_outgoing(&mut *w, msg, self.chunk_bytes)
                        .and_then(|()| w.flush())
                        .is_err()
                    {
                        crate::sys::exit_now(0);
                    }
                    return;
                }
                _ => msg,
            }
        } else {
            msg
        };
        // The writer only goes away when the client is gone; the process
        // exits then, so there is no one left to tell.
        let _ = self.queue.send(msg);
    }
}

/// The writer thread's half: it drains the queue, splitting large readbacks
/// into `chunk_bytes` frames.
pub struct Writer {
    sink: Sink,
    rx: Receiver<Outgoing>,
    chunk_bytes: usize,
}

impl Writer {
    /// Writes until every `Replies` is dropped (`Ok`) or the client is gone
    /// (`Err`, typically a broken pipe).
    pub fn run(self) -> io::Result<()> {
        let chunk_bytes = self.chunk_bytes;
        while let Ok(first) = self.rx.recv() {
            let mut w = self.sink.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            write_outgoing(&mut *w, first, chunk_bytes)?;
            while let Ok(msg) = self.rx.try_recv() {
                write_outgoing(&mut *w, msg, chunk_bytes)?;
            }
            w.flush()?;
        }
        Ok(())
    }
}

fn write_outgoing(w: &mut impl Write, msg: Outgoing, chunk_bytes: usize) -> io::Result<()> {
    match msg {
        Outgoing::Frame(header) => write_frame(w, &header, &[]),
        Outgoing::Data { seq, result, data } => {
            let bytes = data.bytes();
            let mut chunks = bytes.chunks(chunk_bytes.max(1)).peekable();
            while let Some(chunk) = chunks.next() {
                if chunks.peek().is_some() {
                    write_frame(w, &protocol::more(seq), chunk)?;
                } else {
                    write_frame(w, &result, chunk)?;
                }
            }
            if bytes.is_empty() {
                write_frame(w, &result, &[])?;
            }
            Ok(())
        }
    }
}
