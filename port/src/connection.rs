//! The reader and writer threads around the session.
//!
//! The reader turns frames into `Incoming` messages for the session thread;
//! it reads upload payloads straight into MLX-allocated buffers, so tensor
//! bytes are copied once, from the pipe into their final place. The writer
//! owns the output pipe and splits large readbacks into `chunk_bytes` frames.

use crate::budget::budget;
use crate::frame::{write_frame, FrameReader, Head, Limits};
use crate::mlx::{Buffer, Dtype, Evaluated};
use crate::protocol::{self, Id, Malformed, Request};
use crate::term::Term;
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};

pub enum Incoming {
    Request { req: Request, upload: Option<Upload> },
    Malformed(Malformed),
    /// A frame the reader consumed itself (a middle chunk of an upload).
    Consumed,
}

/// The complete bytes of a `from_binary` tensor.
pub struct Upload {
    pub buffer: Buffer,
    pub shape: Vec<i32>,
    pub dtype: Dtype,
}

pub enum Outgoing {
    Frame(Term),
    /// `{:ok, seq, result}` with the evaluated array's bytes as payload,
    /// preceded by `{:more, seq}` frames when they exceed one chunk.
    Data { seq: u64, result: Term, data: Evaluated },
}

struct Pending {
    req: Request,
    upload: Upload,
    filled: usize,
}

/// Reads frames until end of input (`Ok`) or a broken stream (`Err`).
pub fn read_loop(input: impl Read, limits: Limits, tx: Sender<Incoming>) -> io::Result<()> {
    // Small frames arrive many per read; payloads larger than the buffer
    // bypass it and land straight in their MLX buffer.
    let mut frames = FrameReader::new(BufReader::with_capacity(64 << 10, input), limits);
    let mut uploads: HashMap<Id, Pending> = HashMap::new();
    while let Some(head) = frames.next_head()? {
        let msg = incoming(&mut frames, &mut uploads, head, limits)?;
        if tx.send(msg).is_err() {
            break;
        }
    }
    Ok(())
}

fn incoming<R: Read>(
    frames: &mut FrameReader<R>,
    uploads: &mut HashMap<Id, Pending>,
    head: Head,
    limits: Limits,
) -> io::Result<Incoming> {
    let Head { header, payload_len, oversized } = head;
    let parsed = header
        .map_err(|e| Malformed { seq: 0, op: "protocol".into(), outs: vec![], message: e.to_string() })
        .and_then(Request::parse);
    let req = match parsed {
        Ok(req) => req,
        Err(m) => {
            frames.skip_payload()?;
            return Ok(Incoming::Malformed(m));
        }
    };
    if oversized {
        frames.skip_payload()?;
        let message = format!(
            "frame of more than {} bytes refused (send large tensors in chunks of at most {} bytes)",
            limits.max_frame_bytes, limits.chunk_bytes
        );
        uploads.retain(|id, _| !req.outs.contains(id));
        return Ok(refuse(req, "protocol", message));
    }
    match req.op.as_str() {
        "from_binary" => start_upload(frames, uploads, req, payload_len),
        "upload" => continue_upload(frames, uploads, req, payload_len),
        _ => {
            if payload_len > 0 {
                frames.skip_payload()?;
                let message = format!("{} takes no payload, got {payload_len} bytes", req.op);
                let op = req.op.clone();
                return Ok(refuse(req, &op, message));
            }
            Ok(Incoming::Request { req, upload: None })
        }
    }
}

fn refuse(req: Request, op: &str, message: String) -> Incoming {
    Incoming::Malformed(Malformed { seq: req.seq, op: op.to_string(), outs: req.outs, message })
}

fn start_upload<R: Read>(
    frames: &mut FrameReader<R>,
    uploads: &mut HashMap<Id, Pending>,
    req: Request,
    payload_len: usize,
) -> io::Result<Incoming> {
    let (shape, dtype, total) = match upload_attrs(&req) {
        Ok(v) => v,
        Err(message) => {
            frames.skip_payload()?;
            return Ok(refuse(req, "from_binary", message));
        }
    };
    if payload_len > total {
        frames.skip_payload()?;
        let message = format!("payload of {payload_len} bytes exceeds the tensor's {total} bytes");
        return Ok(refuse(req, "from_binary", message));
    }
    if let Err(e) = budget().admit(total) {
        frames.skip_payload()?;
        return Ok(refuse(req, "from_binary", format!("from_binary: {e}")));
    }
    let mut buffer = match Buffer::alloc(total) {
        Ok(b) => b,
        Err(e) => {
            frames.skip_payload()?;
            return Ok(refuse(req, "from_binary", e.message));
        }
    };
    frames.read_payload(&mut buffer.as_mut_slice()[..payload_len])?;
    let pending = Pending { req, upload: Upload { buffer, shape, dtype }, filled: payload_len };
    Ok(finish_or_park(uploads, pending))
}

fn continue_upload<R: Read>(
    frames: &mut FrameReader<R>,
    uploads: &mut HashMap<Id, Pending>,
    req: Request,
    payload_len: usize,
) -> io::Result<Incoming> {
    let id = req.outs.first().copied().unwrap_or(0);
    let Some(mut pending) = uploads.remove(&id) else {
        frames.skip_payload()?;
        return Ok(refuse(req, "upload", format!("no upload in progress for tensor id {id}")));
    };
    let total = pending.upload.buffer.len();
    let offset = req.attrs.as_int();
    if offset != Some(pending.filled as i128) || payload_len > total - pending.filled {
        frames.skip_payload()?;
        let message = format!(
            "chunk at offset {} with {payload_len} bytes does not continue tensor {id} ({} of {total} bytes received)",
            req.attrs, pending.filled
        );
        return Ok(refuse(pending.req, "upload", message));
    }
    let filled = pending.filled;
    frames.read_payload(&mut pending.upload.buffer.as_mut_slice()[filled..filled + payload_len])?;
    pending.filled += payload_len;
    Ok(finish_or_park(uploads, pending))
}

fn finish_or_park(uploads: &mut HashMap<Id, Pending>, pending: Pending) -> Incoming {
    if pending.filled == pending.upload.buffer.len() {
        return Incoming::Request { req: pending.req, upload: Some(pending.upload) };
    }
    let id = pending.req.outs.first().copied().unwrap_or(0);
    uploads.insert(id, pending);
    Incoming::Consumed
}

/// `%{shape: [..], dtype: type, bytes: total}`, checked against each other.
fn upload_attrs(req: &Request) -> Result<(Vec<i32>, Dtype, usize), String> {
    if req.outs.len() != 1 || !req.ins.is_empty() {
        return Err("from_binary defines exactly one id and reads none".into());
    }
    let a = &req.attrs;
    let dims = a.get("shape").and_then(Term::as_list).ok_or("missing attribute shape")?;
    let shape: Vec<i32> = dims
        .iter()
        .map(|d| d.as_int().and_then(|d| i32::try_from(d).ok()).filter(|d| *d >= 0))
        .collect::<Option<_>>()
        .ok_or_else(|| format!("shape dimensions must be integers in 0..2^31, got {}", Term::List(dims.to_vec())))?;
    let dtype = a.get("dtype").and_then(Dtype::from_term).ok_or("missing or unsupported dtype")?;
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

/// Writes outgoing frames until the channel closes (`Ok`) or the client is
/// gone (`Err`, typically a broken pipe).
pub fn write_loop(output: impl Write, chunk_bytes: usize, rx: Receiver<Outgoing>) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(64 << 10, output);
    while let Ok(msg) = rx.recv() {
        match msg {
            Outgoing::Frame(header) => write_frame(&mut w, &header, &[])?,
            Outgoing::Data { seq, result, data } => {
                let bytes = data.bytes();
                let mut chunks = bytes.chunks(chunk_bytes.max(1)).peekable();
                while let Some(chunk) = chunks.next() {
                    if chunks.peek().is_some() {
                        write_frame(&mut w, &protocol::more(seq), chunk)?;
                    } else {
                        write_frame(&mut w, &result, chunk)?;
                    }
                }
                if bytes.is_empty() {
                    write_frame(&mut w, &result, &[])?;
                }
            }
        }
        if rx.is_empty() {
            w.flush()?;
        }
    }
    w.flush()
}
