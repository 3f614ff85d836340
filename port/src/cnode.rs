//! The worker as an Erlang C-node (`moat_port --node NAME@HOST
//! --cookie-file PATH`): the Erlang distribution as a second transport of
//! the same protocol, for a worker on another host than the BEAM.
//!
//! The node registers with its host's epmd as a hidden node and listens on
//! loopback unless `--listen` gives an address. A BEAM node connects with
//! the distribution handshake (`erl_dist`), which the cookie authenticates;
//! a connection that fails it is closed before any message is read. The
//! client then opens a session with `{:open, owner_pid, generation}`, sent
//! to any registered name of this node. From then on each frame of
//! protocol.md is one distribution message: the client sends the frame's
//! body (`<<header_len::32, header, payload>>`, what follows the packet
//! length on the pipe) as a binary to the pid the hello came from, and
//! replies come to the owner as `{pid, {:data, body}}`, the messages a port
//! sends. One client node at a time; its session (tensors, programs) ends
//! with its connection. Shared memory is never offered.
//!
//! Messages are read by hand, not by a general term decoder: a message is
//! bounded before anything is allocated for it, and its envelope is walked
//! in place (`Envelope`), so damaged input costs no more than its length.

use crate::checks::Checks;
use crate::connection::{FrameSink, FrameSource};
use crate::frame::{self, Head, Limits};
use crate::incoming::{read_loop, ReaderConfig};
use crate::replies::{Gone, Outgoing, Replies};
use crate::session::Session;
use crate::sys;
use crate::term::{self, DecodeError, Term};
use crossbeam_channel::bounded;
use erl_dist::epmd::{EpmdClient, NodeEntry, DEFAULT_EPMD_PORT};
use erl_dist::handshake::{HandshakeStatus, ServerSideHandshake};
use erl_dist::node::{LocalNode, NodeName};
use futures::executor::block_on;
use futures::io::AllowStdIo;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// How a C-node runs: set from the command line.
pub struct NodeConfig {
    /// `name@host`.
    pub name: String,
    pub cookie: String,
    pub listen: SocketAddr,
    pub limits: Limits,
    pub checks: Checks,
}

/// The hello of a session of the given generation.
pub type Hello = Arc<dyn Fn(u64) -> Term + Send + Sync>;

/// A handshake that takes longer is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Ticks keep the connection up (a BEAM node drops one that is silent for
/// its `net_ticktime`, 60 s by default).
const TICK: Duration = Duration::from_secs(10);
/// Room in a message for its envelope beside a frame of `max_frame_bytes`.
const ENVELOPE_BYTES: usize = 64 << 10;
/// The message type of the distribution's pass-through headers.
const PASS_THROUGH: u8 = 112;

/// The cookie in `path`: the file must be a regular file of this user that
/// no one else may read or write, as Erlang's own `.erlang.cookie`.
pub fn read_cookie(path: &Path) -> Result<String, String> {
    let at = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("cookie file {at}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("cookie file {at} is not a regular file"));
    }
    if meta.uid() != sys::uid() {
        return Err(format!("cookie file {at} belongs to another user"));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "cookie file {at} is open to other users (mode {:o}): make it owner-only (chmod 600)",
            meta.mode() & 0o777
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cookie file {at}: {e}"))?;
    let cookie = text.trim();
    if cookie.is_empty() {
        return Err(format!("cookie file {at} is empty"));
    }
    Ok(cookie.to_string())
}

/// Registers the node and serves client nodes, one at a time, until the
/// process ends; returns only when it cannot start.
pub fn run(config: NodeConfig, hello: Hello) -> Result<(), String> {
    let name: NodeName = config
        .name
        .parse()
        .map_err(|e| format!("--node {}: {e} (expected name@host)", config.name))?;
    let listener = TcpListener::bind(config.listen).map_err(|e| format!("listen on {}: {e}", config.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let epmd = TcpStream::connect(("127.0.0.1", DEFAULT_EPMD_PORT))
        .map_err(|e| format!("cannot reach epmd on this host ({e}); start it with `epmd -daemon`"))?;
    let entry = NodeEntry::new_hidden(name.name(), addr.port());
    // epmd forgets the node when this connection closes: it stays open for
    // the life of the process.
    let (_registration, creation) = block_on(EpmdClient::new(AllowStdIo::new(epmd)).register(entry))
        .map_err(|e| format!("epmd refused to register {name}: {e}"))?;
    log::warn!("node {name} (hidden) listening on {addr}");
    let node = LocalNode::new(name, creation);
    let busy = Arc::new(AtomicBool::new(false));
    let config = Arc::new(config);
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::warn!("accept failed: {e}");
                continue;
            }
        };
        let (node, busy, config, hello) = (node.clone(), busy.clone(), config.clone(), hello.clone());
        let spawned = thread::Builder::new()
            .name("connection".into())
            .spawn(move || connection(stream, &node, &busy, &config, &hello));
        if let Err(e) = spawned {
            log::error!("cannot start a connection thread: {e}");
        }
    }
    Ok(())
}

/// One connection: the handshake, then the session if it passes and no
/// other client node holds this worker.
fn connection(stream: TcpStream, node: &LocalNode, busy: &AtomicBool, config: &NodeConfig, hello: &Hello) {
    let from = stream
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    // A peer that stalls the handshake does not hold a thread for long.
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let mut handshake = ServerSideHandshake::new(AllowStdIo::new(stream), node.clone(), &config.cookie);
    match block_on(handshake.execute_recv_name()) {
        Ok(Some(_)) => {}
        Ok(None) => {
            log::warn!("refused a connection from {from}: it asks for a dynamic node name");
            return;
        }
        Err(e) => {
            log::warn!("refused a connection from {from}: {e}");
            return;
        }
    }
    let claimed = !busy.swap(true, Ordering::SeqCst);
    let status = if claimed {
        HandshakeStatus::Ok
    } else {
        HandshakeStatus::NotAllowed
    };
    match block_on(handshake.execute_rest(status)) {
        Ok((stream, peer)) => {
            log::info!("node {} connected from {from}", peer.name);
            if let Err(e) = serve(stream.into_inner(), node, config, hello) {
                log::warn!("connection of node {} broken: {e}", peer.name);
            }
            log::info!("node {} disconnected; its session is gone", peer.name);
        }
        Err(e) if claimed => log::warn!("refused a connection from {from}: {e}"),
        Err(_) => log::warn!("refused a connection from {from}: another node holds this worker"),
    }
    if claimed {
        busy.store(false, Ordering::SeqCst);
    }
}

/// A session over an authenticated connection: it starts with the client's
/// `open` and ends with the connection.
fn serve(stream: TcpStream, node: &LocalNode, config: &NodeConfig, hello: &Hello) -> io::Result<()> {
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    let mut source = MessageSource::new(stream.try_clone()?, config.limits);
    let Some(open) = source.await_open()? else {
        return Ok(());
    };
    let out = Arc::new(Mutex::new(DistWriter {
        out: BufWriter::with_capacity(64 << 10, stream.try_clone()?),
        owner: open.owner,
        me: pid_ext(&node.name.to_string(), 1, node.creation.get()),
    }));
    let closer = stream.try_clone()?;
    let gone: Gone = Arc::new(move || {
        let _ = closer.shutdown(Shutdown::Both);
    });
    let (replies, writer) = Replies::with_gone(DistSink(out.clone()), 1024, config.limits.chunk_bytes, gone.clone());
    let stopped = Arc::new(AtomicBool::new(false));
    let ticker = {
        let (out, stopped, gone) = (out.clone(), stopped.clone(), gone.clone());
        thread::Builder::new().name("ticker".into()).spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                thread::park_timeout(TICK);
                let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
                if w.tick().is_err() {
                    gone();
                    return;
                }
            }
        })?
    };
    let writer = {
        let gone = gone.clone();
        thread::Builder::new().name("writer".into()).spawn(move || {
            if writer.run().is_err() {
                gone();
            }
        })?
    };
    replies.send(Outgoing::Frame(hello(open.generation)));
    let (tx, rx) = bounded(256);
    let reader_config = ReaderConfig {
        limits: config.limits,
        generation: open.generation,
        shared_memory: false,
        replies: replies.clone(),
    };
    let reader = thread::Builder::new().name("reader".into()).spawn(move || {
        let read = read_loop(source, reader_config, tx);
        // Replies to a client that hung up have nowhere to go.
        gone();
        read
    })?;
    Session::new(open.generation, replies)
        .with_checks(config.checks)
        .with_shared_memory(false)
        .run(rx);
    stopped.store(true, Ordering::SeqCst);
    ticker.thread().unpark();
    let read = reader.join().unwrap_or(Ok(()));
    let _ = writer.join();
    let _ = ticker.join();
    read
}

/// A client's request for a session.
#[derive(Debug, PartialEq)]
pub struct Open {
    /// The owner's pid, as the distribution encodes it.
    pub owner: Vec<u8>,
    pub generation: u64,
}

/// What one distribution message carries, for this worker.
#[derive(Debug, PartialEq)]
pub enum Envelope {
    /// A frame's body: where it lies in the message.
    Frame(Range<usize>),
    Open(Open),
    /// Not for this worker (a link, a monitor, a message it does not know).
    Other,
    /// Not a message of the distribution's pass-through format.
    Bad(String),
}

/// The ops of control messages that carry a message (SEND, REG_SEND,
/// SEND_SENDER, ALIAS_SEND and their trace-token variants).
const SENDS: &[u8] = &[2, 6, 12, 16, 22, 23, 33, 34];
/// External term format tags used here.
const VERSION: u8 = 131;
const SMALL_INTEGER: u8 = 97;
const INTEGER: u8 = 98;
const SMALL_TUPLE: u8 = 104;
const BINARY: u8 = 109;
const SMALL_BIG: u8 = 110;
const SMALL_ATOM_UTF8: u8 = 119;
const NEW_PID: u8 = 88;
/// Terms nest at most this deep in a control message.
const MAX_DEPTH: usize = 16;

/// Reads one message (what follows its length: the type tag, the control
/// message, the message) in place.
pub fn envelope(msg: &[u8]) -> Envelope {
    match walk(msg) {
        Ok(e) => e,
        Err(why) => Envelope::Bad(why),
    }
}

fn walk(msg: &[u8]) -> Result<Envelope, String> {
    let mut c = Cursor { buf: msg, pos: 0 };
    let tag = c.u8()?;
    if tag != PASS_THROUGH {
        return Err(format!("distribution message of type {tag}, expected {PASS_THROUGH}"));
    }
    c.expect(VERSION)?;
    let arity = c.tuple()?;
    if arity == 0 {
        return Err("empty control message".into());
    }
    let op = match c.u8()? {
        SMALL_INTEGER => c.u8()?,
        _ => return Ok(Envelope::Other),
    };
    for _ in 1..arity {
        c.skip(0)?;
    }
    if !SENDS.contains(&op) {
        return Ok(Envelope::Other);
    }
    c.expect(VERSION)?;
    let start = c.pos;
    match c.u8()? {
        BINARY => {
            let len = c.u32()? as usize;
            let body = c.take(len)?;
            c.end()?;
            Ok(Envelope::Frame(body))
        }
        SMALL_TUPLE => {
            c.pos = start;
            match open(&mut c) {
                Some(open) => Ok(Envelope::Open(open)),
                None => Ok(Envelope::Other),
            }
        }
        _ => Ok(Envelope::Other),
    }
}

/// `{:open, owner, generation}`.
fn open(c: &mut Cursor) -> Option<Open> {
    if c.tuple().ok()? != 3 || c.u8().ok()? != SMALL_ATOM_UTF8 || c.u8().ok()? != 4 {
        return None;
    }
    if c.bytes(4).ok()? != b"open" {
        return None;
    }
    let pid_at = c.pos;
    if c.u8().ok()? != NEW_PID {
        return None;
    }
    c.pos = pid_at;
    c.skip(0).ok()?;
    let owner = c.buf[pid_at..c.pos].to_vec();
    let generation = match c.u8().ok()? {
        SMALL_INTEGER => c.u8().ok()? as u64,
        INTEGER => u64::try_from(c.u32().ok()? as i32).ok()?,
        SMALL_BIG => {
            let n = c.u8().ok()? as usize;
            if c.u8().ok()? != 0 || n > 8 {
                return None;
            }
            c.bytes(n)
                .ok()?
                .iter()
                .rev()
                .fold(0u64, |acc, b| (acc << 8) | *b as u64)
        }
        _ => return None,
    };
    c.end().ok()?;
    (generation > 0).then_some(Open { owner, generation })
}

/// A position in a message; every read is bounds-checked.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn bytes(&mut self, n: usize) -> Result<&[u8], String> {
        let range = self.take(n)?;
        Ok(&self.buf[range])
    }

    fn take(&mut self, n: usize) -> Result<Range<usize>, String> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.buf.len());
        let end = end.ok_or_else(|| format!("message cut short at byte {}", self.pos))?;
        let range = self.pos..end;
        self.pos = end;
        Ok(range)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.bytes(1)?[0])
    }

    fn u16(&mut self) -> Result<usize, String> {
        let b = self.bytes(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]) as usize)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.bytes(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn expect(&mut self, byte: u8) -> Result<(), String> {
        let at = self.pos;
        match self.u8()? {
            b if b == byte => Ok(()),
            b => Err(format!("byte {at} is {b}, expected {byte}")),
        }
    }

    fn tuple(&mut self) -> Result<usize, String> {
        match self.u8()? {
            SMALL_TUPLE => Ok(self.u8()? as usize),
            105 => Ok(self.u32()? as usize),
            tag => Err(format!("expected a tuple, got tag {tag}")),
        }
    }

    fn end(&self) -> Result<(), String> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            n => Err(format!("{n} bytes after the message")),
        }
    }

    /// Skips one term without allocating; each element takes at least one
    /// byte, so a lying count runs into the end of the message.
    fn skip(&mut self, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err("terms nest too deep".into());
        }
        let tag = self.u8()?;
        let n = match tag {
            SMALL_INTEGER => 1,
            INTEGER => 4,
            70 => 8,
            SMALL_ATOM_UTF8 | 115 => self.u8()? as usize,
            118 | 100 => self.u16()?,
            106 => 0,
            107 => self.u16()?,
            BINARY => self.u32()? as usize,
            77 => self.u32()? as usize + 1,
            SMALL_BIG => self.u8()? as usize + 1,
            111 => self.u32()? as usize + 1,
            NEW_PID | 103 => {
                self.skip(depth + 1)?;
                if tag == NEW_PID {
                    12
                } else {
                    9
                }
            }
            90 | 114 => {
                let words = self.u16()?;
                self.skip(depth + 1)?;
                if tag == 90 {
                    4 + 4 * words
                } else {
                    1 + 4 * words
                }
            }
            SMALL_TUPLE | 105 => {
                self.pos -= 1;
                for _ in 0..self.tuple()? {
                    self.skip(depth + 1)?;
                }
                0
            }
            108 | 116 => {
                let count = self.u32()? as usize;
                let terms = if tag == 116 { count.saturating_mul(2) } else { count + 1 };
                for _ in 0..terms {
                    self.skip(depth + 1)?;
                }
                0
            }
            tag => return Err(format!("unsupported term tag {tag} in a control message")),
        };
        self.take(n).map(|_| ())
    }
}

/// Frames from the distribution messages of one connection (a `FrameSource`
/// over any byte stream: a socket, or a fuzzer's bytes).
pub struct MessageSource<R> {
    input: BufReader<R>,
    limits: Limits,
    msg: Vec<u8>,
    /// The current frame's payload not yet read, in `msg`.
    payload: Range<usize>,
}

impl<R: Read> MessageSource<R> {
    pub fn new(input: R, limits: Limits) -> Self {
        MessageSource {
            input: BufReader::with_capacity(64 << 10, input),
            limits,
            msg: Vec::new(),
            payload: 0..0,
        }
    }

    /// The largest message read: a frame of `max_frame_bytes` and its envelope.
    fn max_message(&self) -> usize {
        self.limits.max_frame_bytes.saturating_add(ENVELOPE_BYTES)
    }

    /// The next message: `Ok(None)` at the end of input; an `Err` envelope
    /// for one too large to read, whose bytes are skipped unread.
    fn next_message(&mut self) -> io::Result<Option<Envelope>> {
        loop {
            let mut len = [0u8; 4];
            match self.input.read_exact(&mut len) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
                Err(e) => return Err(e),
            }
            let len = u32::from_be_bytes(len) as usize;
            if len == 0 {
                continue; // a tick
            }
            if len > self.max_message() {
                let skipped = io::copy(&mut (&mut self.input).take(len as u64), &mut io::sink())?;
                if skipped as usize != len {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                let why = format!(
                    "distribution message of {len} bytes refused (the limit is {}: send large tensors in chunks)",
                    self.max_message()
                );
                return Ok(Some(Envelope::Bad(why)));
            }
            self.msg.clear();
            self.msg.resize(len, 0);
            self.input.read_exact(&mut self.msg)?;
            return Ok(Some(envelope(&self.msg)));
        }
    }

    /// Waits for the client's `open`; `Ok(None)` if it hangs up first.
    pub fn await_open(&mut self) -> io::Result<Option<Open>> {
        while let Some(envelope) = self.next_message()? {
            match envelope {
                Envelope::Open(open) => return Ok(Some(open)),
                other => log::debug!("message before the session's open ignored: {other:?}"),
            }
        }
        Ok(None)
    }
}

impl<R: Read> FrameSource for MessageSource<R> {
    fn next_head(&mut self) -> io::Result<Option<Head>> {
        self.payload = 0..0;
        while let Some(envelope) = self.next_message()? {
            let refused = |why: String| Head {
                header: Err(DecodeError(why)),
                payload_len: 0,
                oversized: false,
            };
            match envelope {
                Envelope::Frame(body) => {
                    let (head, payload_at) = frame::head_of(&self.msg[body.clone()], &self.limits);
                    self.payload = body.start + payload_at..body.end;
                    return Ok(Some(head));
                }
                Envelope::Bad(why) => return Ok(Some(refused(why))),
                Envelope::Open(_) => {
                    return Ok(Some(refused(
                        "a second open on one connection (reconnect for a new session)".into(),
                    )))
                }
                Envelope::Other => {}
            }
        }
        Ok(None)
    }

    fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
        if dst.len() > self.payload.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "read past the frame's payload",
            ));
        }
        let start = self.payload.start;
        dst.copy_from_slice(&self.msg[start..start + dst.len()]);
        self.payload.start += dst.len();
        Ok(())
    }

    fn skip_payload(&mut self) -> io::Result<()> {
        self.payload = 0..0;
        Ok(())
    }
}

/// `NEW_PID_EXT` of a pid of this node.
fn pid_ext(node: &str, id: u32, creation: u32) -> Vec<u8> {
    let mut pid = vec![NEW_PID, SMALL_ATOM_UTF8, node.len() as u8];
    pid.extend_from_slice(node.as_bytes());
    pid.extend_from_slice(&id.to_be_bytes());
    pid.extend_from_slice(&0u32.to_be_bytes());
    pid.extend_from_slice(&creation.to_be_bytes());
    pid
}

/// Writes frames as messages `{me, {:data, body}}` to the owner.
struct DistWriter {
    out: BufWriter<TcpStream>,
    owner: Vec<u8>,
    me: Vec<u8>,
}

impl DistWriter {
    fn frame(&mut self, header: &Term, payload: &[u8]) -> io::Result<()> {
        let header = term::encode(header);
        let body_len = 4 + header.len() + payload.len();
        // SEND: {2, '', owner}
        let mut envelope = vec![
            PASS_THROUGH,
            VERSION,
            SMALL_TUPLE,
            3,
            SMALL_INTEGER,
            2,
            SMALL_ATOM_UTF8,
            0,
        ];
        envelope.extend_from_slice(&self.owner);
        envelope.extend_from_slice(&[VERSION, SMALL_TUPLE, 2]);
        envelope.extend_from_slice(&self.me);
        envelope.extend_from_slice(&[SMALL_TUPLE, 2, SMALL_ATOM_UTF8, 4]);
        envelope.extend_from_slice(b"data");
        envelope.push(BINARY);
        let too_large = || io::Error::new(io::ErrorKind::InvalidInput, "frame of 4 GiB or more");
        let body_len32 = u32::try_from(body_len).map_err(|_| too_large())?;
        envelope.extend_from_slice(&body_len32.to_be_bytes());
        let total = u32::try_from(envelope.len() + body_len).map_err(|_| too_large())?;
        self.out.write_all(&total.to_be_bytes())?;
        self.out.write_all(&envelope)?;
        self.out.write_all(&(header.len() as u32).to_be_bytes())?;
        self.out.write_all(&header)?;
        self.out.write_all(payload)
    }

    fn tick(&mut self) -> io::Result<()> {
        self.out.write_all(&[0; 4])?;
        self.out.flush()
    }
}

struct DistSink(Arc<Mutex<DistWriter>>);

impl DistSink {
    fn lock(&self) -> std::sync::MutexGuard<'_, DistWriter> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl FrameSink for DistSink {
    fn write_frame(&mut self, header: &Term, payload: &[u8]) -> io::Result<()> {
        self.lock().frame(header, payload)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.lock().out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message as a BEAM node sends `send(pid, body)`.
    fn send(message: &[u8]) -> Vec<u8> {
        let mut msg = vec![
            PASS_THROUGH,
            VERSION,
            SMALL_TUPLE,
            3,
            SMALL_INTEGER,
            2,
            SMALL_ATOM_UTF8,
            0,
        ];
        msg.extend(pid_ext("moat@127.0.0.1", 1, 7));
        msg.push(VERSION);
        msg.extend_from_slice(message);
        msg
    }

    fn binary(bytes: &[u8]) -> Vec<u8> {
        let mut m = vec![BINARY];
        m.extend((bytes.len() as u32).to_be_bytes());
        m.extend_from_slice(bytes);
        m
    }

    #[test]
    fn a_binary_is_a_frame_and_open_opens() {
        let msg = send(&binary(b"abc"));
        assert_eq!(envelope(&msg), Envelope::Frame(msg.len() - 3..msg.len()));
        let owner = pid_ext("a@127.0.0.1", 77, 3);
        let mut open = vec![SMALL_TUPLE, 3, SMALL_ATOM_UTF8, 4];
        open.extend_from_slice(b"open");
        open.extend(&owner);
        open.extend([SMALL_INTEGER, 5]);
        assert_eq!(envelope(&send(&open)), Envelope::Open(Open { owner, generation: 5 }));
    }

    #[test]
    fn damaged_messages_are_refused() {
        let msg = send(&binary(b"abc"));
        for cut in 0..msg.len() {
            assert!(
                matches!(envelope(&msg[..cut]), Envelope::Bad(_) | Envelope::Other),
                "cut at {cut}"
            );
        }
        let mut lying = send(&binary(b"abc"));
        let at = lying.len() - 7;
        lying[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(envelope(&lying), Envelope::Bad(_)));
    }

    #[test]
    fn oversized_messages_are_skipped_unread() {
        let limits = Limits {
            max_frame_bytes: 16,
            ..Limits::default()
        };
        let big = send(&binary(&vec![1u8; ENVELOPE_BYTES + 64]));
        let small = send(&binary(&[0, 0, 0, 0]));
        let mut bytes = Vec::new();
        for m in [&big, &small] {
            bytes.extend((m.len() as u32).to_be_bytes());
            bytes.extend_from_slice(m);
        }
        let mut source = MessageSource::new(&bytes[..], limits);
        let head = source.next_head().unwrap().unwrap();
        assert!(head.header.unwrap_err().0.contains("refused"));
        let head = source.next_head().unwrap().unwrap();
        assert!(head.header.is_err() && head.payload_len == 0);
        assert!(source.next_head().unwrap().is_none());
    }
}
