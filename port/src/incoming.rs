//! Requests from frames: the reader thread's work, above any transport.
//!
//! It turns frames into `Incoming` messages for the session thread, each
//! request decoded once (`session::Command`), and serves the upload family
//! itself, as those must not wait for the session: it reassembles
//! piped uploads, reading their payloads straight into MLX-allocated
//! buffers (so tensor bytes are copied once, from the transport into their
//! final place), and it stages shared-memory uploads (see `shared`): it
//! makes the memory file and answers at once, and maps the file once the
//! client has filled it. Frames come from any `FrameSource`.

use crate::budget::budget;
use crate::connection::FrameSource;
use crate::failure::Failure;
use crate::frame::{Head, Limits};
use crate::mlx::{Buffer, Dtype};
use crate::protocol::{self, Id, Malformed, Request, FROM_BINARY};
use crate::replies::{Outgoing, Replies};
use crate::session::{Incoming, Name, Upload};
use crate::shared::Staged;
use crate::term::Term;
use crossbeam_channel::Sender;
use std::collections::HashMap;
use std::io;

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

/// Frames turned into messages, with the uploads in progress between them.
pub struct Reader<S> {
    frames: S,
    config: ReaderConfig,
    uploads: HashMap<Id, Pending>,
    staged: HashMap<Id, Staged>,
}

/// Reads frames until end of input (`Ok`) or a broken stream (`Err`).
pub fn read_loop(frames: impl FrameSource, config: ReaderConfig, tx: Sender<Incoming>) -> io::Result<()> {
    let mut reader = Reader::new(frames, config);
    while let Some(msg) = reader.read()? {
        hand_over(&msg);
        if tx.send(msg).is_err() {
            break;
        }
    }
    Ok(())
}

/// Marks a message handed to the session thread by another (see `spin`).
pub fn hand_over(msg: &Incoming) {
    stamp_read(msg);
    crate::spin::handed_over();
}

/// The trace's stamp of a request read and decoded (see `trace`).
pub fn stamp_read(msg: &Incoming) {
    if let Incoming::Call { call, .. } = msg {
        crate::trace::stamp("R", call.seq);
    }
}

impl<S> Reader<S> {
    pub fn new(frames: S, config: ReaderConfig) -> Reader<S> {
        Reader {
            frames,
            config,
            uploads: HashMap::new(),
            staged: HashMap::new(),
        }
    }

    /// The frames it reads.
    pub fn frames(&self) -> &S {
        &self.frames
    }
}

impl<S: FrameSource> Reader<S> {
    /// The next frame as a message; `Ok(None)` at a clean end of input.
    pub fn read(&mut self) -> io::Result<Option<Incoming>> {
        match self.frames.next_head()? {
            Some(head) => self.incoming(head).map(Some),
            None => Ok(None),
        }
    }

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
        let name = Name::parse(&req.op);
        match name {
            Some(Name::FromBinary | Name::Upload) if req.seq != 0 => {
                let message = format!("{} is fire-and-forget: send it with seq 0", req.op);
                let failure = Failure::protocol(&req.op, message);
                self.refuse(req, failure)
            }
            Some(Name::FromBinary) => self.start_upload(req, payload_len),
            Some(Name::Upload) => self.continue_upload(req, payload_len),
            _ if payload_len > 0 => {
                let message = format!("{} takes no payload, got {payload_len} bytes", req.op);
                let failure = Failure::protocol(&req.op, message);
                self.refuse(req, failure)
            }
            Some(Name::UploadFile) => self.stage(req),
            Some(Name::FromFile) => self.map_file(req),
            Some(Name::Release) => {
                // Uploads that never completed go with their ids: their
                // sender died between chunks, or before filling its file.
                for id in &req.ins {
                    self.uploads.remove(id);
                    self.staged.remove(id);
                }
                Ok(Incoming::decode(req, name))
            }
            _ => Ok(Incoming::decode(req, name)),
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
            return Incoming::upload(req, Upload::Piped { buffer, shape, dtype });
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
            Ok(mapped) => Ok(Incoming::upload(req, Upload::Shared(mapped))),
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
