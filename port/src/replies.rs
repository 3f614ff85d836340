//! Replies: the way out of the worker, above any transport. Frames go to
//! a `FrameSink`; large readbacks are split into `chunk_bytes` frames.

use crate::connection::{FrameSink, PIPE_BUFFER};
use crate::mlx::Evaluated;
use crate::protocol;
use crate::term::Term;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::io;
use std::sync::{Arc, Mutex};

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
    gone: Gone,
}

/// The largest readback the session thread writes itself: one pipe
/// buffer's worth, so that a write never waits long on a reader slow to
/// drain the pipe.
const INLINE_BYTES: usize = PIPE_BUFFER;

type Sink = Arc<Mutex<Box<dyn FrameSink>>>;

/// What a thread does when it finds the client gone.
pub type Gone = Arc<dyn Fn() + Send + Sync>;

impl Replies {
    /// The replies and the writer thread's queue, over `sink`; readbacks
    /// go in frames of at most `chunk_bytes`. A failed write means the
    /// client is gone, and the process exits (the port's worker has no one
    /// else to serve).
    pub fn new(sink: impl FrameSink + 'static, capacity: usize, chunk_bytes: usize) -> (Replies, Writer) {
        Replies::with_gone(sink, capacity, chunk_bytes, Arc::new(|| crate::sys::exit_now(0)))
    }

    /// As `new`, with `gone` run instead when a write fails.
    pub fn with_gone(
        sink: impl FrameSink + 'static,
        capacity: usize,
        chunk_bytes: usize,
        gone: Gone,
    ) -> (Replies, Writer) {
        let (queue, rx) = bounded(capacity);
        let sink: Sink = Arc::new(Mutex::new(Box::new(sink)));
        let chunk_bytes = chunk_bytes.max(1);
        (
            Replies {
                queue,
                sink: sink.clone(),
                chunk_bytes,
                gone,
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

    /// Sends `msg`; a failed write means the client is gone (see `new`).
    pub fn send(&self, msg: Outgoing) {
        let msg = if self.inline(&msg) && self.queue.is_empty() {
            match self.sink.try_lock() {
                Ok(mut w) if self.queue.is_empty() => {
                    if write_outgoing(&mut **w, msg, self.chunk_bytes)
                        .and_then(|()| w.flush())
                        .is_err()
                    {
                        drop(w);
                        (self.gone)();
                    }
                    return;
                }
                _ => msg,
            }
        } else {
            msg
        };
        // The writer only goes away when the client is gone, and then there
        // is no one left to tell.
        let _ = self.queue.send(msg);
    }
}

impl Replies {
    /// Sends `msg` through the writer thread, behind everything queued,
    /// never written at once: frames sent this way keep their order among
    /// themselves (a run's hook frames and its reply, which one inline
    /// write could overtake).
    pub fn send_queued(&self, msg: Outgoing) {
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
            write_outgoing(&mut **w, first, chunk_bytes)?;
            while let Ok(msg) = self.rx.try_recv() {
                write_outgoing(&mut **w, msg, chunk_bytes)?;
            }
            w.flush()?;
        }
        Ok(())
    }
}

fn write_outgoing(w: &mut dyn FrameSink, msg: Outgoing, chunk_bytes: usize) -> io::Result<()> {
    match msg {
        Outgoing::Frame(header) => w.write_frame(&header, &[]),
        Outgoing::Data { seq, result, data } => {
            let bytes = data.bytes();
            let mut chunks = bytes.chunks(chunk_bytes.max(1)).peekable();
            while let Some(chunk) = chunks.next() {
                if chunks.peek().is_some() {
                    w.write_frame(&protocol::more(seq), chunk)?;
                } else {
                    w.write_frame(&result, chunk)?;
                }
            }
            if bytes.is_empty() {
                w.write_frame(&result, &[])?;
            }
            Ok(())
        }
    }
}
