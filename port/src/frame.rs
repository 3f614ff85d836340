//! Frames inside `{packet, 4}` packets: `<<header_len::32, header, payload>>`.
//!
//! The reader never trusts a length: a packet larger than `max_frame_bytes`
//! is refused before anything is allocated for it (its bytes are read and
//! dropped to keep the stream in step), and the header must fit in the packet
//! and under `max_header_bytes`.

use crate::term::{self, DecodeError, Term};
use std::io::{self, Read, Write};

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_header_bytes: usize,
    pub max_frame_bytes: usize,
    pub chunk_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: 1 << 20,
            max_frame_bytes: 320 << 20,
            chunk_bytes: 64 << 20,
        }
    }
}

/// The start of an incoming frame: its decoded header and how many payload
/// bytes follow. The payload is still in the stream: the caller reads it into
/// its destination, or skips it.
#[derive(Debug)]
pub struct Head {
    pub header: Result<Term, DecodeError>,
    pub payload_len: usize,
    /// Larger than `max_frame_bytes`: the payload must be skipped.
    pub oversized: bool,
}

pub struct FrameReader<R> {
    inner: R,
    limits: Limits,
    /// Payload bytes of the current frame not yet consumed.
    pending: usize,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R, limits: Limits) -> Self {
        FrameReader {
            inner,
            limits,
            pending: 0,
        }
    }

    /// The stream it reads from.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// Reads the next frame's header. `Ok(None)` is a clean end of input.
    pub fn next_head(&mut self) -> io::Result<Option<Head>> {
        if self.pending > 0 {
            self.skip_payload()?;
        }
        let mut len = [0u8; 4];
        if !read_exact_or_eof(&mut self.inner, &mut len)? {
            return Ok(None);
        }
        let packet_len = u32::from_be_bytes(len) as usize;
        let oversized = packet_len > self.limits.max_frame_bytes;
        if packet_len < 4 {
            self.discard(packet_len)?;
            return Ok(Some(Head {
                header: Err(bad("packet shorter than its header length")),
                payload_len: 0,
                oversized,
            }));
        }
        let mut hlen = [0u8; 4];
        self.inner.read_exact(&mut hlen)?;
        let header_len = u32::from_be_bytes(hlen) as usize;
        let rest = packet_len - 4;
        if header_len > rest || header_len > self.limits.max_header_bytes {
            self.discard(rest)?;
            let why = format!("header length {header_len} exceeds the packet ({rest} bytes) or the header limit");
            return Ok(Some(Head {
                header: Err(bad(&why)),
                payload_len: 0,
                oversized,
            }));
        }
        let mut header = vec![0u8; header_len];
        self.inner.read_exact(&mut header)?;
        self.pending = rest - header_len;
        Ok(Some(Head {
            header: term::decode(&header),
            payload_len: self.pending,
            oversized,
        }))
    }

    /// Reads the next `dst.len()` payload bytes of the current frame.
    pub fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
        if dst.len() > self.pending {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "read past the frame's payload",
            ));
        }
        self.inner.read_exact(dst)?;
        self.pending -= dst.len();
        Ok(())
    }

    /// Drops whatever is left of the current frame's payload.
    pub fn skip_payload(&mut self) -> io::Result<()> {
        let n = std::mem::take(&mut self.pending);
        self.discard(n)
    }

    fn discard(&mut self, n: usize) -> io::Result<()> {
        let copied = io::copy(&mut (&mut self.inner).take(n as u64), &mut io::sink())?;
        if copied as usize != n {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }
}

fn bad(msg: &str) -> DecodeError {
    DecodeError(msg.to_string())
}

fn read_exact_or_eof(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Writes one frame: packet length, header length, header, payload.
pub fn write_frame(w: &mut impl Write, header: &Term, payload: &[u8]) -> io::Result<()> {
    let header = term::encode(header);
    let packet_len = 4 + header.len() + payload.len();
    let packet_len =
        u32::try_from(packet_len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame of 4 GiB or more"))?;
    w.write_all(&packet_len.to_be_bytes())?;
    w.write_all(&(header.len() as u32).to_be_bytes())?;
    w.write_all(&header)?;
    w.write_all(payload)
}

/// The head of a frame whose whole body (what follows the packet length)
/// is in memory, by the rules `FrameReader` applies to a stream, and where
/// its payload starts in `body`.
pub fn head_of(body: &[u8], limits: &Limits) -> (Head, usize) {
    let oversized = body.len() > limits.max_frame_bytes;
    let refused = |why: String| {
        let head = Head {
            header: Err(DecodeError(why)),
            payload_len: 0,
            oversized,
        };
        (head, body.len())
    };
    if body.len() < 4 {
        return refused("packet shorter than its header length".into());
    }
    let header_len = u32::from_be_bytes([body[0], body[1], body[2], body[3]]) as usize;
    let rest = body.len() - 4;
    if header_len > rest || header_len > limits.max_header_bytes {
        return refused(format!(
            "header length {header_len} exceeds the packet ({rest} bytes) or the header limit"
        ));
    }
    let head = Head {
        header: term::decode(&body[4..4 + header_len]),
        payload_len: rest - header_len,
        oversized,
    };
    (head, 4 + header_len)
}

/// Splits a frame body (what follows the packet length) into header and payload.
pub fn split_body(body: &[u8]) -> Result<(Term, &[u8]), DecodeError> {
    if body.len() < 4 {
        return Err(bad("frame shorter than its header length"));
    }
    let header_len = u32::from_be_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if header_len > body.len() - 4 {
        return Err(bad("header length exceeds the frame"));
    }
    Ok((term::decode(&body[4..4 + header_len])?, &body[4 + header_len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(header: &Term, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_frame(&mut out, header, payload).unwrap();
        out
    }

    #[test]
    fn reads_back_what_it_writes() {
        let mut bytes = packet(&Term::atom("a"), b"xyz");
        bytes.extend(packet(&Term::int(5), b""));
        let mut r = FrameReader::new(&bytes[..], Limits::default());
        let head = r.next_head().unwrap().unwrap();
        assert_eq!(head.header.unwrap(), Term::atom("a"));
        let mut p = [0u8; 3];
        r.read_payload(&mut p).unwrap();
        assert_eq!(&p, b"xyz");
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::int(5));
        assert!(r.next_head().unwrap().is_none());
    }

    #[test]
    fn oversized_frames_are_flagged_and_skipped() {
        let limits = Limits {
            max_frame_bytes: 64,
            ..Limits::default()
        };
        let mut bytes = packet(&Term::atom("big"), &[7u8; 100]);
        bytes.extend(packet(&Term::atom("next"), b""));
        let mut r = FrameReader::new(&bytes[..], limits);
        let head = r.next_head().unwrap().unwrap();
        assert!(head.oversized);
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::atom("next"));
    }

    #[test]
    fn a_header_longer_than_its_packet_keeps_the_stream_in_step() {
        let mut bytes = vec![0, 0, 0, 6, 0, 0, 0, 99, 1, 2];
        bytes.extend(packet(&Term::atom("next"), b""));
        let mut r = FrameReader::new(&bytes[..], Limits::default());
        assert!(r.next_head().unwrap().unwrap().header.is_err());
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::atom("next"));
    }
}
