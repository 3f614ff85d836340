//! Frames inside `{packet, 4}` packets: `<<header_len::32, header, payload>>`.
//!
//! The reader never trusts a length: a packet larger than `max_frame_bytes`
//! is refused before anything is allocated for it (its bytes are read and
//! dropped to keep the stream in step), and the header must fit in the packet
//! and under `max_header_bytes`.
//!
//! A packet whose header length is 0 is a batch (protocol.md §1,
//! "Batches"): its body is more packets, `<<len::32, frame>>` each, read one
//! by one as if each had come alone, each checked against the same limits.
//! A batch's own length is not limited: nothing is allocated for it. A bad
//! inner length prefix ends the batch with one error; a well-framed inner
//! packet that is bad itself is refused alone and the batch reads on.

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
    /// Bytes of the current batch packet after the current frame.
    batch_left: usize,
    /// Bytes of the current batch packet after its header length.
    batch_len: usize,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R, limits: Limits) -> Self {
        FrameReader {
            inner,
            limits,
            pending: 0,
            batch_left: 0,
            batch_len: 0,
        }
    }

    /// The stream it reads from.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// Whether it is inside a batch packet (protocol.md §1, "Batches"): the
    /// rest of the batch is on its way, so a read will not wait long.
    pub fn in_batch(&self) -> bool {
        self.batch_left > 0
    }

    /// Reads the next frame's header. `Ok(None)` is a clean end of input.
    /// The frames of a batch packet come one by one, as if each had come in
    /// a packet of its own.
    pub fn next_head(&mut self) -> io::Result<Option<Head>> {
        if self.pending > 0 {
            self.skip_payload()?;
        }
        loop {
            if self.batch_left > 0 {
                return self.next_in_batch().map(Some);
            }
            let mut len = [0u8; 4];
            if !read_exact_or_eof(&mut self.inner, &mut len)? {
                return Ok(None);
            }
            let packet_len = u32::from_be_bytes(len) as usize;
            if packet_len < 4 {
                return self
                    .refuse(packet_len, packet_len, "packet shorter than its header length")
                    .map(Some);
            }
            let header_len = self.read_u32()?;
            if header_len == 0 {
                if packet_len == 4 {
                    return self
                        .refuse(0, 4, "malformed batch: a batch packet with no frames")
                        .map(Some);
                }
                // A batch: its inner packets follow.
                self.batch_left = packet_len - 4;
                self.batch_len = packet_len - 4;
                continue;
            }
            return self.frame(packet_len, header_len).map(Some);
        }
    }

    /// The next inner packet of the current batch. A bad inner length
    /// prefix (fewer than 4 bytes left for it, 0, or more than is left of
    /// the batch) ends the batch: its rest is dropped with one error. An
    /// inner packet that is well framed but bad itself (too short for a
    /// header length, a batch inside the batch, a lying header length, over
    /// the limits) is refused like a lone packet, and reading goes on with
    /// the next inner packet.
    fn next_in_batch(&mut self) -> io::Result<Head> {
        let left = self.batch_left;
        let at = self.batch_len - left;
        let batch = self.batch_len;
        if left < 4 {
            self.batch_left = 0;
            let why = format!(
                "malformed batch: {left} bytes left at its end (byte {at} of {batch}), too few for a packet length; \
                 they are dropped"
            );
            return self.refuse(left, 0, &why);
        }
        let inner_len = self.read_u32()?;
        let left = left - 4;
        if inner_len == 0 || inner_len > left {
            self.batch_left = 0;
            let why = if inner_len == 0 {
                format!(
                    "malformed batch: an inner packet length of 0 at byte {at} of {batch}; \
                     the rest of the batch ({left} bytes) is dropped"
                )
            } else {
                format!(
                    "malformed batch: an inner packet of {inner_len} bytes exceeds the {left} bytes left in its batch \
                     (at byte {at} of {batch}); the rest of the batch is dropped"
                )
            };
            return self.refuse(left, 0, &why);
        }
        self.batch_left = left - inner_len;
        if inner_len < 4 {
            let why = "malformed batch: an inner packet shorter than its header length";
            return self.refuse(inner_len, inner_len, why);
        }
        let header_len = self.read_u32()?;
        if header_len == 0 {
            return self.refuse(inner_len - 4, inner_len, "malformed batch: a batch inside a batch");
        }
        self.frame(inner_len, header_len)
    }

    /// A frame of `packet_len` bytes whose header length has been read.
    fn frame(&mut self, packet_len: usize, header_len: usize) -> io::Result<Head> {
        let oversized = packet_len > self.limits.max_frame_bytes;
        let rest = packet_len - 4;
        if header_len > rest || header_len > self.limits.max_header_bytes {
            let why = format!("header length {header_len} exceeds the packet ({rest} bytes) or the header limit");
            return self.refuse(rest, packet_len, &why);
        }
        let mut header = vec![0u8; header_len];
        self.inner.read_exact(&mut header)?;
        self.pending = rest - header_len;
        Ok(Head {
            header: term::decode(&header),
            payload_len: self.pending,
            oversized,
        })
    }

    /// Drops `skip` bytes (what is left of a refused packet of `packet_len`
    /// bytes) and answers with an error head.
    fn refuse(&mut self, skip: usize, packet_len: usize, why: &str) -> io::Result<Head> {
        self.discard(skip)?;
        Ok(Head {
            header: Err(bad(why)),
            payload_len: 0,
            oversized: packet_len > self.limits.max_frame_bytes,
        })
    }

    fn read_u32(&mut self) -> io::Result<usize> {
        let mut b = [0u8; 4];
        self.inner.read_exact(&mut b)?;
        Ok(u32::from_be_bytes(b) as usize)
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

    fn batch(packets: &[Vec<u8>]) -> Vec<u8> {
        let body: Vec<u8> = packets.concat();
        let mut out = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        out.extend([0, 0, 0, 0]);
        out.extend(body);
        out
    }

    #[test]
    fn a_batch_reads_as_its_frames_one_by_one() {
        let mut bytes = batch(&[
            packet(&Term::atom("a"), b"xy"),
            packet(&Term::int(2), b""),
            packet(&Term::atom("c"), b"z"),
        ]);
        bytes.extend(packet(&Term::atom("alone"), b""));
        let mut r = FrameReader::new(&bytes[..], Limits::default());
        let head = r.next_head().unwrap().unwrap();
        assert_eq!(head.header.unwrap(), Term::atom("a"));
        assert!(r.in_batch());
        let mut p = [0u8; 2];
        r.read_payload(&mut p).unwrap();
        assert_eq!(&p, b"xy");
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::int(2));
        // An unread payload is skipped within the batch.
        let head = r.next_head().unwrap().unwrap();
        assert_eq!((head.header.unwrap(), head.payload_len), (Term::atom("c"), 1));
        assert!(!r.in_batch());
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::atom("alone"));
        assert!(r.next_head().unwrap().is_none());
    }

    #[test]
    fn each_frame_of_a_batch_is_checked_against_the_limits() {
        let limits = Limits {
            max_frame_bytes: 64,
            ..Limits::default()
        };
        let bytes = batch(&[
            packet(&Term::atom("big"), &[7u8; 100]),
            packet(&Term::atom("next"), b""),
        ]);
        let mut r = FrameReader::new(&bytes[..], limits);
        let head = r.next_head().unwrap().unwrap();
        assert!(head.oversized);
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::atom("next"));
        assert!(r.next_head().unwrap().is_none());
    }

    fn error_of(head: Head) -> String {
        head.header.unwrap_err().0
    }

    #[test]
    fn malformed_batches_are_protocol_errors_that_keep_the_stream_in_step() {
        let next = packet(&Term::atom("next"), b"");
        // An empty batch.
        let mut bytes = batch(&[]);
        // An inner packet longer than what is left of its batch.
        bytes.extend([0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 99, 1, 2, 3, 4]);
        // Two stray bytes at a batch's end.
        bytes.extend(batch(&[packet(&Term::int(1), b""), vec![9, 9]]));
        // A batch inside a batch, and an inner packet too short for a header length.
        bytes.extend(batch(&[batch(&[packet(&Term::int(2), b"")]), vec![0, 0, 0, 2, 5, 5]]));
        bytes.extend(&next);
        let mut r = FrameReader::new(&bytes[..], Limits::default());
        let why = error_of(r.next_head().unwrap().unwrap());
        assert!(why.contains("a batch packet with no frames"), "{why}");
        let why = error_of(r.next_head().unwrap().unwrap());
        assert!(why.contains("exceeds the 4 bytes left in its batch"), "{why}");
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::int(1));
        let why = error_of(r.next_head().unwrap().unwrap());
        assert!(why.contains("2 bytes left at its end"), "{why}");
        let why = error_of(r.next_head().unwrap().unwrap());
        assert!(why.contains("a batch inside a batch"), "{why}");
        let why = error_of(r.next_head().unwrap().unwrap());
        assert!(why.contains("shorter than its header length"), "{why}");
        assert_eq!(r.next_head().unwrap().unwrap().header.unwrap(), Term::atom("next"));
        assert!(r.next_head().unwrap().is_none());
    }

    #[test]
    fn a_bad_inner_length_ends_its_batch_with_one_error() {
        let next = packet(&Term::atom("next"), b"");
        // A frame, then a zero length and zeros to the batch's end: one error, not one per 4 bytes.
        let mut bytes = batch(&[packet(&Term::int(1), b""), vec![0; 14]]);
        // A frame, a length that overruns the batch, and what would read as a frame after it.
        bytes.extend(batch(&[packet(&Term::int(2), b""), vec![0, 0, 1, 0], next.clone()]));
        // Well-framed but bad inner packets are refused one by one and the batch reads on.
        bytes.extend(batch(&[
            vec![0, 0, 0, 1, 7],
            vec![0, 0, 0, 6, 0, 0, 0, 99, 1, 2],
            packet(&Term::int(3), b""),
        ]));
        bytes.extend(&next);
        let mut r = FrameReader::new(&bytes[..], Limits::default());
        let mut heads = Vec::new();
        while let Some(head) = r.next_head().unwrap() {
            heads.push(head.header.map_err(|e| e.0));
        }
        let why = |i: usize| heads[i].clone().unwrap_err();
        assert_eq!(heads.len(), 8, "{heads:?}");
        assert_eq!(heads[0], Ok(Term::int(1)));
        assert!(
            why(1).contains("an inner packet length of 0 at byte 11 of 25"),
            "{}",
            why(1)
        );
        assert!(
            why(1).contains("the rest of the batch (10 bytes) is dropped"),
            "{}",
            why(1)
        );
        assert_eq!(heads[2], Ok(Term::int(2)));
        assert!(why(3).contains("exceeds the"), "{}", why(3));
        assert!(why(3).contains("the rest of the batch is dropped"), "{}", why(3));
        assert!(why(4).contains("shorter than its header length"), "{}", why(4));
        assert!(why(5).contains("header length 99 exceeds the packet"), "{}", why(5));
        // The third batch's last frame, then the lone packet after it.
        assert_eq!(heads[6], Ok(Term::int(3)));
        assert_eq!(heads[7], Ok(Term::atom("next")));
    }
}
