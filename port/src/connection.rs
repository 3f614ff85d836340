//! Framing, and nothing above it: where frames come from (`FrameSource`)
//! and where they go (`FrameSink`). Everything above (upload reassembly in
//! `incoming`, readback chunking in `replies`, the session) is written
//! against these two traits, so each transport supplies only them: the
//! port's pipes here (`{packet, 4}` packets on fds 3 and 4), the Erlang
//! distribution in `cnode` (one frame per message).

use crate::frame::{self, FrameReader, Head, Limits};
use crate::term::Term;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::fd::AsRawFd;

/// Incoming frames, one at a time: a frame's header first, then its payload,
/// which the caller reads into its destination or skips.
pub trait FrameSource {
    /// The next frame's header; `Ok(None)` is a clean end of input, `Err` a
    /// broken stream.
    fn next_head(&mut self) -> io::Result<Option<Head>>;
    /// Reads the next `dst.len()` payload bytes of the current frame.
    fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<()>;
    /// Drops whatever is left of the current frame's payload.
    fn skip_payload(&mut self) -> io::Result<()>;
}

/// Outgoing frames. `Err` from either method means the client is gone.
pub trait FrameSink: Send {
    fn write_frame(&mut self, header: &Term, payload: &[u8]) -> io::Result<()>;
    /// Pushes out what `write_frame` may have buffered.
    fn flush(&mut self) -> io::Result<()>;
}

impl<R: Read> FrameSource for FrameReader<R> {
    fn next_head(&mut self) -> io::Result<Option<Head>> {
        FrameReader::next_head(self)
    }

    fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
        FrameReader::read_payload(self, dst)
    }

    fn skip_payload(&mut self) -> io::Result<()> {
        FrameReader::skip_payload(self)
    }
}

/// A source that can tell whether its next read would block (the session
/// acknowledges what it has served before it blocks, see `input`).
pub trait Ready {
    /// Whether a read would return at once.
    fn ready(&self) -> bool {
        self.poll(false)
    }
    /// Blocks until a read would return at once.
    fn wait(&self) {
        self.poll(true);
    }
    fn poll(&self, block: bool) -> bool;
}

impl<F: Read + AsRawFd> Ready for FrameReader<BufReader<F>> {
    fn poll(&self, block: bool) -> bool {
        let buffered = self.get_ref();
        self.in_batch() || !buffered.buffer().is_empty() || crate::sys::readable(buffered.get_ref().as_raw_fd(), block)
    }
}

/// Frames from a pipe. Small frames arrive many per read; payloads larger
/// than the buffer bypass it and land straight in their destination.
pub fn pipe_source<R: Read>(input: R, limits: Limits) -> FrameReader<BufReader<R>> {
    FrameReader::new(BufReader::with_capacity(64 << 10, input), limits)
}

/// Frames into a pipe, buffered until `flush`.
pub struct PipeSink<W: Write>(BufWriter<W>);

/// The pipe's buffer: one pipe's worth, so a flush never waits long on a
/// reader slow to drain it.
pub const PIPE_BUFFER: usize = 64 << 10;

impl<W: Write> PipeSink<W> {
    pub fn new(output: W) -> Self {
        PipeSink(BufWriter::with_capacity(PIPE_BUFFER, output))
    }
}

impl<W: Write + Send> FrameSink for PipeSink<W> {
    fn write_frame(&mut self, header: &Term, payload: &[u8]) -> io::Result<()> {
        frame::write_frame(&mut self.0, header, payload)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}
