//! Fuzzers for every decoder on the worker's input path, run for a bounded
//! time (`MOAT_FUZZ_SECS`, default 2 s each; `bin/soak` runs them longer).
//! Stable Rust has no cargo-fuzz, so these are seeded mutation fuzzers: they
//! start from valid frames and damage them at the byte level (flips,
//! interesting values, cuts, splices, lying lengths) and at the term level
//! (any subterm replaced by a random term). A failure prints the seed
//! (`MOAT_FUZZ_SEED` replays it) and the input.
//!
//! * the term decoder never panics, and what it accepts re-encodes stably;
//! * the frame reader never panics and always makes progress, one reader over
//!   a whole stream of lone packets and batch packets (valid, malformed,
//!   damaged); on a stream whose packet lengths add up, it gives exactly the
//!   heads protocol.md §1 ("Batches") predicts: each frame's header and
//!   payload length, alone or inside a batch, and one refusal per bad frame
//!   and per malformed batch;
//! * the reader thread turns every frame into exactly one message, whether it
//!   came alone or inside a batch packet, and a malformed batch into the
//!   errors protocol.md §1 ("Batches") predicts: one for a bad inner length
//!   prefix (the rest of its batch dropped), one per well-framed bad inner
//!   packet;
//! * the C-node's reader of distribution messages (`cnode`) refuses damaged,
//!   lying and oversized messages without a panic, at a cost bounded by the
//!   message's length, and turns each frame message into one message;
//! * a real worker fed damaged frames answers protocol errors and keeps
//!   serving, without crashing;
//! * a real worker fed every graph op of protocol.md with edge-case
//!   attributes (zeros, negatives, wrong lengths, huge counts, any term) and
//!   inputs, alone or as the step of a program, evaluates each or fails it,
//!   without crashing.

mod common;

use common::report;
use common::*;
use crossbeam_channel::unbounded;
use moat_port::cnode::{envelope, Envelope, MessageSource};
use moat_port::connection::{pipe_source, PipeSink};
use moat_port::frame::{split_body, write_frame, FrameReader, Head, Limits};
use moat_port::incoming::{read_loop, ReaderConfig};
use moat_port::protocol::{map, Request};
use moat_port::replies::Replies;
use moat_port::session::Incoming;
use moat_port::term::{decode, encode, Term};
use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::Stdio;
use std::time::Instant;

/// Counts the bytes this thread allocates, so a test can bound what decoding
/// one input costs.
struct Counting;

thread_local! {
    static ALLOCATED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

// SAFETY: defers every call to the system allocator unchanged; the counter
// is a const-initialised thread local, which never allocates.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATED.with(|a| a.set(a.get() + layout.size()));
        std::alloc::System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        std::alloc::System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// What `f` allocated on this thread, in bytes.
fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.with(|a| a.get());
    let out = f();
    (out, ALLOCATED.with(|a| a.get()) - before)
}

/// splitmix64: small, seedable, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn seeded() -> (Rng, u64) {
        let seed = std::env::var("MOAT_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        (Rng(seed), seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

fn f32s(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
}

/// Valid request frames covering every request shape the worker knows. No
/// frame here evaluates a graph (no `to_binary`, `eval` or `async_eval`):
/// damaged attrs can describe enormous lazy arrays, and evaluating those is a
/// memory limit's job, not the decoders'.
fn corpus() -> Vec<(Term, Vec<u8>)> {
    let g = 3;
    let f32_ty = || map(vec![("type", ty("f", 32))]);
    let mut c = vec![
        (
            request(0, g, "from_binary", &[1], &[], tensor_attrs(&[2, 2], "f", 32, 16)),
            f32s(4),
        ),
        (
            request(0, g, "from_binary", &[2], &[], tensor_attrs(&[2, 2], "f", 32, 16)),
            f32s(4),
        ),
        (
            request(0, g, "from_binary", &[3], &[], tensor_attrs(&[3], "s", 32, 12)),
            vec![1; 12],
        ),
        (
            request(0, g, "from_binary", &[4], &[], tensor_attrs(&[2], "f", 64, 16)),
            vec![0; 16],
        ),
        (
            request(0, g, "from_binary", &[5], &[], tensor_attrs(&[4], "pred", 8, 4)),
            vec![1, 0, 1, 0],
        ),
        (
            request(0, g, "from_binary", &[6], &[], tensor_attrs(&[8], "u", 8, 8)),
            vec![7; 8],
        ),
        // An upload in two chunks.
        (
            request(0, g, "from_binary", &[7], &[], tensor_attrs(&[4], "f", 32, 16)),
            f32s(2),
        ),
        (request(0, g, "upload", &[7], &[], Term::int(8)), f32s(2)),
        (request(0, g, "astype", &[20], &[1], f32_ty()), vec![]),
        (
            request(0, g, "reshape", &[21], &[1], map(vec![("shape", ids(&[4]))])),
            vec![],
        ),
        (
            request(
                0,
                g,
                "reshape",
                &[22],
                &[1],
                map(vec![("shape", Term::List(vec![Term::int(-1), Term::int(1)]))]),
            ),
            vec![],
        ),
        (
            request(0, g, "broadcast_to", &[23], &[3], map(vec![("shape", ids(&[2, 3]))])),
            vec![],
        ),
        (
            request(
                0,
                g,
                "sum",
                &[24],
                &[1],
                map(vec![
                    ("axes", ids(&[0])),
                    ("keep_axes", Term::atom("true")),
                    ("type", ty("f", 32)),
                ]),
            ),
            vec![],
        ),
        (request(0, g, "matmul", &[25], &[1, 2], f32_ty()), vec![]),
        (request(9, g, "metadata", &[], &[25], nil()), vec![]),
        (request(10, g, "sync", &[], &[], nil()), vec![]),
        (request(0, g, "release", &[], &[20, 21], nil()), vec![]),
    ];
    for (i, op) in ["add", "subtract", "multiply", "divide"].iter().enumerate() {
        c.push((request(0, g, op, &[30 + i as u64], &[1, 2], f32_ty()), vec![]));
    }
    c
}

fn body(header: &Term, payload: &[u8]) -> Vec<u8> {
    let mut packet = Vec::new();
    write_frame(&mut packet, header, payload).unwrap();
    packet.split_off(4)
}

const ATOMS: &[&str] = &[
    "nil",
    "true",
    "false",
    "add",
    "subtract",
    "multiply",
    "divide",
    "matmul",
    "sum",
    "astype",
    "reshape",
    "broadcast_to",
    "from_binary",
    "upload",
    "release",
    "sync",
    "metadata",
    "f",
    "s",
    "u",
    "bf",
    "c",
    "pred",
    "type",
    "shape",
    "axes",
    "keep_axes",
    "dtype",
    "bytes",
    "",
    "\u{fc}ber",
];

fn interesting_int(rng: &mut Rng) -> i128 {
    let picks: &[i128] = &[
        0,
        1,
        -1,
        2,
        3,
        4,
        8,
        16,
        32,
        64,
        255,
        256,
        -256,
        65535,
        i32::MAX as i128,
        i32::MIN as i128,
        1 << 31,
        1 << 32,
        i64::MAX as i128,
        i64::MIN as i128,
        u64::MAX as i128,
        1 << 64,
        i128::MAX,
        -i128::MAX,
    ];
    if rng.chance(3) {
        (rng.next() >> rng.below(64)) as i128 * if rng.chance(2) { -1 } else { 1 }
    } else {
        *rng.pick(picks)
    }
}

fn random_term(rng: &mut Rng, depth: usize) -> Term {
    let leaf = depth >= 3 || rng.chance(2);
    match (leaf, rng.below(7)) {
        (true, 0 | 1) => Term::Int(interesting_int(rng)),
        (true, 2) => Term::Float(f64::from_bits(rng.next())),
        (true, 3 | 4) => Term::atom(ATOMS[rng.below(ATOMS.len())]),
        (true, _) => Term::Binary((0..rng.below(12)).map(|_| rng.next() as u8).collect()),
        (false, 0 | 1) => Term::Tuple((0..rng.below(7)).map(|_| random_term(rng, depth + 1)).collect()),
        (false, 2 | 3) => Term::List((0..rng.below(5)).map(|_| random_term(rng, depth + 1)).collect()),
        (false, 4) => Term::Map(
            (0..rng.below(4))
                .map(|_| (random_term(rng, depth + 1), random_term(rng, depth + 1)))
                .collect(),
        ),
        (false, 5) => Term::atom(ATOMS[rng.below(ATOMS.len())]),
        (false, _) => Term::Int(interesting_int(rng)),
    }
}

/// Replaces one random subterm (possibly the whole term) with a random term.
fn mutate_term(t: &Term, rng: &mut Rng) -> Term {
    let children = match t {
        Term::Tuple(v) | Term::List(v) => v.len(),
        Term::Map(p) => 2 * p.len(),
        _ => 0,
    };
    if children == 0 || rng.chance(4) {
        return random_term(rng, 1);
    }
    let i = rng.below(children);
    match t {
        Term::Tuple(v) | Term::List(v) => {
            let mut v = v.clone();
            v[i] = mutate_term(&v[i], rng);
            if matches!(t, Term::Tuple(_)) {
                Term::Tuple(v)
            } else {
                Term::List(v)
            }
        }
        Term::Map(p) => {
            let mut p = p.clone();
            let (k, v) = &mut p[i / 2];
            if i.is_multiple_of(2) {
                *k = mutate_term(k, rng);
            } else {
                *v = mutate_term(v, rng);
            }
            Term::Map(p)
        }
        _ => unreachable!(),
    }
}

/// Byte-level damage: flips, interesting bytes, cuts, insertions, splices and
/// lying length fields.
fn mutate_bytes(bytes: &mut Vec<u8>, other: &[u8], rng: &mut Rng) {
    for _ in 0..1 + rng.below(4) {
        let len = bytes.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                bytes[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                bytes[i] = *rng.pick(&[
                    0, 1, 0x7f, 0x80, 0xff, 131, 97, 98, 104, 106, 107, 108, 109, 110, 116, 119,
                ]);
            }
            2 => bytes.truncate(rng.below(len + 1)),
            3 => {
                let i = rng.below(len + 1);
                let junk: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.next() as u8).collect();
                bytes.splice(i..i, junk);
            }
            4 if len > 4 => {
                // A 32-bit length field somewhere (header length, list, binary, map sizes).
                let i = rng.below(len - 3);
                let v = *rng.pick(&[
                    0u32,
                    1,
                    0x7fff_ffff,
                    0xffff_ffff,
                    0x0100_0000,
                    len as u32,
                    len as u32 + 1,
                ]);
                bytes[i..i + 4].copy_from_slice(&v.to_be_bytes());
            }
            5 if !other.is_empty() => {
                let i = rng.below(len + 1);
                let j = rng.below(other.len());
                bytes.truncate(i);
                bytes.extend_from_slice(&other[j..]);
            }
            6 if len > 1 => {
                let i = rng.below(len);
                let j = i + rng.below(len - i);
                let dup = bytes[i..j].to_vec();
                bytes.splice(j..j, dup);
            }
            _ => {
                let i = rng.below(len + 1);
                bytes.truncate(i);
            }
        }
    }
}

/// One damaged frame body (what follows the packet length).
fn damaged_body(corpus: &[(Term, Vec<u8>)], rng: &mut Rng) -> Vec<u8> {
    let (header, payload) = rng.pick(corpus);
    if rng.chance(2) {
        let header = mutate_term(header, rng);
        let payload = if rng.chance(4) {
            payload[..rng.below(payload.len() + 1)].to_vec()
        } else {
            payload.clone()
        };
        body(&header, &payload)
    } else {
        let mut b = body(header, payload);
        let (h2, p2) = rng.pick(corpus);
        mutate_bytes(&mut b, &body(h2, p2), rng);
        b
    }
}

/// One batch packet's body (protocol.md §1, "Batches"): a zero header
/// length, then inner packets, valid or damaged, whose length prefixes may
/// lie (0, more than is left), maybe a stray tail of fewer than 4 bytes, a
/// batch inside the batch, or no frames at all; or, now and then, a valid
/// batch damaged at the byte level.
fn batch_body(corpus: &[(Term, Vec<u8>)], rng: &mut Rng) -> Vec<u8> {
    let mut b = vec![0, 0, 0, 0];
    if rng.chance(16) {
        return b;
    }
    for _ in 0..1 + rng.below(6) {
        let inner = match rng.below(8) {
            0 => damaged_body(corpus, rng),
            1 => {
                // A batch inside the batch.
                let (h, p) = rng.pick(corpus);
                let mut nested = vec![0, 0, 0, 0];
                let f = body(h, p);
                nested.extend_from_slice(&(f.len() as u32).to_be_bytes());
                nested.extend_from_slice(&f);
                nested
            }
            2 => (0..rng.below(4)).map(|_| rng.next() as u8).collect(),
            _ => {
                let (h, p) = rng.pick(corpus);
                body(h, p)
            }
        };
        let len = match rng.below(16) {
            0 => 0,
            1 => inner.len() as u32 + 1 + rng.below(64) as u32,
            2 => rng.next() as u32,
            _ => inner.len() as u32,
        };
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(&inner);
    }
    match rng.below(8) {
        0 => b.extend((0..1 + rng.below(3)).map(|_| rng.next() as u8)),
        1 => b.extend([0; 8]),
        2 => {
            let (h, p) = rng.pick(corpus);
            mutate_bytes(&mut b, &body(h, p), rng);
            if b.len() >= 4 {
                b[..4].copy_from_slice(&[0; 4]);
            }
        }
        _ => {}
    }
    b
}

/// What the reader thread must make of one frame or malformed batch, by
/// protocol.md §1: the model `the_reader_turns_every_packet_into_exactly_one_message`
/// checks the reader against.
#[derive(Debug)]
enum Expect<'a> {
    /// A frame body (what follows its packet length), alone or inside a batch.
    Frame { body: &'a [u8], in_batch: bool },
    /// A bad inner length prefix: one error, the rest of its batch dropped.
    BadLength,
    /// A batch packet with no frames in it.
    EmptyBatch,
}

fn be32(b: &[u8]) -> usize {
    u32::from_be_bytes(b[..4].try_into().unwrap()) as usize
}

/// The messages a stream of well-framed packets must turn into, in order.
fn expected(mut rest: &[u8]) -> Vec<Expect<'_>> {
    let mut out = Vec::new();
    while rest.len() >= 4 {
        let n = be32(rest);
        let body = &rest[4..4 + n];
        rest = &rest[4 + n..];
        if body.len() < 4 || be32(body) != 0 {
            out.push(Expect::Frame { body, in_batch: false });
            continue;
        }
        let mut inner = &body[4..];
        if inner.is_empty() {
            out.push(Expect::EmptyBatch);
        }
        while !inner.is_empty() {
            if inner.len() < 4 {
                out.push(Expect::BadLength);
                break;
            }
            let m = be32(inner);
            if m == 0 || m > inner.len() - 4 {
                out.push(Expect::BadLength);
                break;
            }
            out.push(Expect::Frame {
                body: &inner[4..4 + m],
                in_batch: true,
            });
            inner = &inner[4 + m..];
        }
    }
    out
}

/// Checks one message against what the model expects of it.
fn check_message(expect: &Expect, message: &Incoming, limits: &Limits) {
    let refusal = |m: &Incoming| match m {
        Incoming::Malformed(m) => Some((m.seq, m.failure.message.clone())),
        _ => None,
    };
    match expect {
        Expect::BadLength | Expect::EmptyBatch => {
            let (seq, why) = refusal(message).expect("a malformed batch is refused");
            assert_eq!(seq, 0, "{why}");
            assert!(why.contains("malformed batch"), "{why}");
            let names = match expect {
                Expect::EmptyBatch => "a batch packet with no frames",
                _ => "dropped",
            };
            assert!(why.contains(names), "{why}");
        }
        Expect::Frame { body, in_batch } => {
            if body.len() < 4 || be32(body) > limits.max_header_bytes {
                assert!(
                    refusal(message).is_some(),
                    "a frame too short or a header too long is refused"
                );
                return;
            }
            if *in_batch && be32(body) == 0 {
                let (seq, why) = refusal(message).expect("a batch inside a batch is refused");
                assert_eq!(seq, 0);
                assert!(why.contains("a batch inside a batch"), "{why}");
                return;
            }
            let req = split_body(body)
                .ok()
                .and_then(|(header, _)| Request::parse(header).ok());
            match req {
                None => assert!(refusal(message).is_some(), "a frame that does not parse is refused"),
                // A call is answered: it reaches the session as a request, or
                // as a refusal carrying its seq (upload chunks sent as calls).
                Some(req) if req.seq != 0 => match message {
                    Incoming::Call { call, .. } => assert_eq!(call.seq, req.seq),
                    Incoming::Malformed(m) => assert_eq!(m.seq, req.seq, "{}", m.failure.message),
                    Incoming::Consumed => panic!("call {} vanished", req.seq),
                },
                Some(_) => {}
            }
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs `check` on inputs from `gen` until the budget is spent; a panic
/// reports the seed and the input. Returns how many inputs ran.
fn fuzz(name: &str, gen: impl Fn(&mut Rng) -> Vec<u8>, check: impl Fn(&[u8])) -> u64 {
    let (mut rng, seed) = Rng::seeded();
    let budget = report::fuzz_budget(2.0);
    let start = Instant::now();
    let mut runs = 0u64;
    while start.elapsed() < budget {
        let input = gen(&mut rng);
        if catch_unwind(AssertUnwindSafe(|| check(&input))).is_err() {
            panic!(
                "{name}: failed on input {} (MOAT_FUZZ_SEED={seed}, run {runs})",
                hex(&input)
            );
        }
        runs += 1;
    }
    println!("{name}: {runs} inputs in {:?} (seed {seed})", start.elapsed());
    runs
}

#[test]
fn the_term_decoder_never_panics_and_what_it_accepts_reencodes_stably() {
    let corpus = corpus();
    let gen = |rng: &mut Rng| {
        if rng.chance(8) {
            (0..rng.below(64)).map(|_| rng.next() as u8).collect()
        } else {
            let mut header = encode(&rng.pick(&corpus).0);
            let other = encode(&rng.pick(&corpus).0);
            mutate_bytes(&mut header, &other, rng);
            header
        }
    };
    let runs = fuzz("term decoder", gen, |input| {
        // A hostile header costs at most a constant times its own size.
        let (decoded, cost) = allocated_by(|| decode(input));
        assert!(
            cost <= 64 * input.len() + 1024,
            "decoding {} bytes allocated {cost}",
            input.len()
        );
        if let Ok(term) = decoded {
            let once = encode(&term);
            let again = decode(&once).expect("the decoder refused what the encoder wrote");
            assert_eq!(encode(&again), once, "re-encoding is not stable for {term}");
            let _ = Request::parse(term);
        }
    });
    report::row(
        "malformed",
        "damaged header terms (term decoder, in process)",
        runs,
        runs,
        0,
        "no panic; cost bounded by the input's size; accepted terms re-encode identically",
    );
}

/// Whether `stream`'s packet lengths add up to exactly its length (what the
/// BEAM's `{packet, 4}` writes): `expected` then models every packet.
fn well_framed(mut rest: &[u8]) -> bool {
    while rest.len() >= 4 {
        let n = be32(rest);
        if n > rest.len() - 4 {
            return false;
        }
        rest = &rest[4 + n..];
    }
    rest.is_empty()
}

/// Checks one head of the frame reader against what the model expects of it.
fn check_head(expect: &Expect, head: &Head, limits: &Limits) {
    let refusal = |head: &Head| match &head.header {
        Err(e) => Some(e.0.clone()),
        Ok(_) => None,
    };
    match expect {
        Expect::BadLength => {
            let why = refusal(head).expect("a bad inner length is refused");
            assert!(why.contains("malformed batch") && why.contains("dropped"), "{why}");
            assert_eq!(head.payload_len, 0);
        }
        Expect::EmptyBatch => {
            let why = refusal(head).expect("an empty batch is refused");
            assert!(why.contains("a batch packet with no frames"), "{why}");
        }
        Expect::Frame { body, in_batch } => {
            if body.len() < 4 {
                assert!(
                    refusal(head).is_some(),
                    "a frame too short for its header length is refused"
                );
                return;
            }
            let header_len = be32(body);
            if *in_batch && header_len == 0 {
                let why = refusal(head).expect("a batch inside a batch is refused");
                assert!(why.contains("a batch inside a batch"), "{why}");
                return;
            }
            if header_len > body.len() - 4 || header_len > limits.max_header_bytes {
                let why = refusal(head).expect("a lying or oversized header length is refused");
                assert!(why.contains("header length"), "{why}");
                return;
            }
            // Compared re-encoded: a NaN in a header is not equal to itself.
            match (&head.header, decode(&body[4..4 + header_len])) {
                (Ok(got), Ok(want)) => assert_eq!(encode(got), encode(&want), "the frame's header, decoded"),
                (got, want) => assert_eq!(got, &want, "the frame's header, decoded"),
            }
            assert_eq!(
                head.payload_len,
                body.len() - 4 - header_len,
                "the frame's payload length"
            );
            assert_eq!(head.oversized, body.len() > limits.max_frame_bytes, "oversized");
        }
    }
}

#[test]
fn the_frame_reader_never_panics_and_always_makes_progress() {
    let corpus = corpus();
    let gen = |rng: &mut Rng| {
        // Several packets, lone frames and batches, whose lengths may lie,
        // then maybe junk.
        let mut stream = Vec::new();
        for _ in 0..1 + rng.below(6) {
            let b = if rng.chance(3) {
                batch_body(&corpus, rng)
            } else {
                damaged_body(&corpus, rng)
            };
            let len = if rng.chance(8) {
                rng.next() as u32 % (b.len() as u32 + 16)
            } else {
                b.len() as u32
            };
            stream.extend_from_slice(&len.to_be_bytes());
            stream.extend_from_slice(&b);
        }
        if rng.chance(8) {
            stream.extend((0..rng.below(16)).map(|_| rng.next() as u8));
        }
        stream
    };
    let limits = Limits {
        max_header_bytes: 256,
        max_frame_bytes: 512,
        chunk_bytes: 128,
    };
    let modelled = std::cell::Cell::new(0u64);
    let batched = std::cell::Cell::new(0u64);
    let runs = fuzz("frame reader", gen, |input| {
        // One reader over the whole stream, as the worker's: a batch's
        // frames come one by one from it.
        let mut frames = FrameReader::new(Cursor::new(input), limits);
        let mut heads = Vec::new();
        let mut clean_end = false;
        loop {
            let before = frames.get_ref().position();
            let head = match frames.next_head() {
                Ok(Some(head)) => head,
                Ok(None) => {
                    clean_end = true;
                    break;
                }
                Err(_) => break,
            };
            assert!(frames.get_ref().position() > before, "no progress at offset {before}");
            if let Ok(header) = &head.header {
                let _ = Request::parse(header.clone());
            }
            heads.push(head);
            if frames.skip_payload().is_err() {
                break;
            }
        }
        if !well_framed(input) {
            return;
        }
        let expect = expected(input);
        assert!(clean_end, "a well-framed stream reads to its end");
        assert_eq!(frames.get_ref().position() as usize, input.len());
        assert!(!frames.in_batch());
        assert_eq!(
            heads.len(),
            expect.len(),
            "one head per frame and per malformed batch: {expect:?}"
        );
        for (e, h) in expect.iter().zip(&heads) {
            check_head(e, h, &limits);
        }
        modelled.set(modelled.get() + 1);
        let in_batch = expect
            .iter()
            .filter(|e| matches!(e, Expect::Frame { in_batch: true, .. }))
            .count();
        batched.set(batched.get() + in_batch as u64);
    });
    report::row(
        "malformed",
        "damaged byte streams (frame reader, in process)",
        runs,
        runs,
        0,
        &format!(
            "no panic; progress on every head; one reader per stream of lone and batch packets; \
             the {} well-framed streams gave exactly the heads protocol.md §1 predicts ({} frames inside batches)",
            modelled.get(),
            batched.get()
        ),
    );
    println!(
        "frame reader: {} of {runs} streams well framed and modelled, {} frames inside batches",
        modelled.get(),
        batched.get()
    );
}

#[test]
fn the_reader_turns_every_packet_into_exactly_one_message() {
    let corpus = corpus();
    let gen = |rng: &mut Rng| {
        // Well-framed packets (the BEAM writes the packet length) with
        // damaged bodies, and batch packets, valid or malformed.
        let mut stream = Vec::new();
        for _ in 0..1 + rng.below(8) {
            let b = match rng.below(8) {
                0 | 1 => {
                    let (h, p) = rng.pick(&corpus);
                    body(h, p)
                }
                2 | 3 => batch_body(&corpus, rng),
                _ => damaged_body(&corpus, rng),
            };
            stream.extend_from_slice(&(b.len() as u32).to_be_bytes());
            stream.extend_from_slice(&b);
        }
        stream
    };
    let limits = Limits {
        max_header_bytes: 4096,
        max_frame_bytes: 256,
        chunk_bytes: 64,
    };
    let runs = fuzz("reader thread", gen, |input| {
        let expect = expected(input);
        let (tx, rx) = unbounded();
        let (replies, _writer) = Replies::new(PipeSink::new(std::io::sink()), 1024, limits.chunk_bytes);
        let config = ReaderConfig {
            limits,
            generation: 3,
            shared_memory: false,
            replies,
        };
        read_loop(pipe_source(Cursor::new(input), limits), config, tx)
            .expect("a well-framed stream never breaks the reader");
        let messages: Vec<Incoming> = rx.try_iter().collect();
        assert_eq!(
            messages.len(),
            expect.len(),
            "one message per frame and per malformed batch: {expect:?}"
        );
        for (e, m) in expect.iter().zip(&messages) {
            check_message(e, m, &limits);
        }
    });
    report::row(
        "malformed",
        "damaged frames (reader thread, in process)",
        runs,
        runs,
        0,
        "exactly the messages the model of protocol.md §1 predicts (one per frame, alone or batched; one per malformed batch); no call lost",
    );
}

/// A distribution message as a BEAM node sends `send(pid, message)`: the
/// pass-through tag, the control message `{2, '', pid}`, the message.
fn dist_send(message: &[u8]) -> Vec<u8> {
    let node = b"moat@127.0.0.1";
    let mut msg = vec![112, 131, 104, 3, 97, 2, 119, 0, 88, 119, node.len() as u8];
    msg.extend_from_slice(node);
    msg.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 7, 131]);
    msg.extend_from_slice(message);
    msg
}

fn dist_binary(bytes: &[u8]) -> Vec<u8> {
    let mut m = vec![109];
    m.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    m.extend_from_slice(bytes);
    dist_send(&m)
}

#[test]
fn the_cnode_reader_refuses_damaged_messages_and_answers_every_frame() {
    let corpus = corpus();
    let limits = Limits {
        max_header_bytes: 4096,
        max_frame_bytes: 256,
        chunk_bytes: 64,
    };
    // Well-delimited messages (the distribution's length prefix is the
    // kernel's TCP stream, as the packet length is the pipe's): frames,
    // damaged frames, damaged envelopes, ticks, and messages too large to
    // read, whose length alone is sent.
    let gen = |rng: &mut Rng| {
        let mut stream = Vec::new();
        for _ in 0..1 + rng.below(8) {
            let msg = match rng.below(5) {
                0 => {
                    let (h, p) = rng.pick(&corpus);
                    dist_binary(&body(h, p))
                }
                1 => dist_binary(&damaged_body(&corpus, rng)),
                2 => {
                    let (h, p) = rng.pick(&corpus);
                    let mut m = dist_binary(&body(h, p));
                    let other = dist_binary(&damaged_body(&corpus, rng));
                    mutate_bytes(&mut m, &other, rng);
                    m
                }
                3 => Vec::new(),
                _ => {
                    let len = 256 + (64 << 10) + 1 + rng.below(1 << 20);
                    stream.extend_from_slice(&(len as u32).to_be_bytes());
                    stream.extend((0..len).map(|_| 0u8));
                    continue;
                }
            };
            stream.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            stream.extend_from_slice(&msg);
        }
        stream
    };
    let runs = fuzz("cnode reader", gen, |input| {
        // Each message by itself: the envelope is walked in place.
        let mut rest = input;
        let mut frames = 0;
        while rest.len() >= 4 {
            let n = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            let msg = &rest[4..4 + n];
            let (e, cost) = allocated_by(|| envelope(msg));
            assert!(cost < 4096, "walking a message of {n} bytes cost {cost} bytes");
            if let Envelope::Frame(body) = e {
                assert!(body.end <= msg.len());
                frames += 1;
            }
            rest = &rest[4 + n..];
        }
        // The whole stream through the reader thread's loop.
        let (tx, rx) = unbounded();
        let (replies, _writer) = Replies::new(PipeSink::new(std::io::sink()), 1024, limits.chunk_bytes);
        let config = ReaderConfig {
            limits,
            generation: 3,
            shared_memory: false,
            replies,
        };
        read_loop(MessageSource::new(Cursor::new(input), limits), config, tx)
            .expect("well-delimited messages never break the reader");
        let messages = rx.try_iter().count();
        assert!(messages >= frames, "{frames} frame messages gave {messages} messages");
    });
    report::row(
        "malformed",
        "damaged distribution messages (C-node reader, in process)",
        runs,
        runs,
        0,
        "no panic; bounded cost; every frame message answered",
    );
}

/// Seqs of the harness's own barrier calls, far from any the fuzzer writes.
const BARRIER: u64 = 1 << 62;

#[test]
fn a_worker_fed_damaged_frames_refuses_them_and_keeps_serving() {
    let corpus = corpus();
    let (mut rng, seed) = Rng::seeded();
    let budget = report::fuzz_budget(2.0);
    let mut w = Worker::start_with(
        &[
            "--max-frame-bytes",
            "4096",
            "--chunk-bytes",
            "1024",
            "--log-level",
            "error",
        ],
        Stdio::null(),
    );
    let start = Instant::now();
    let (mut sent, mut refusals, mut barriers) = (0u64, 0u64, 0u64);
    let mut recent: Vec<Vec<u8>> = Vec::new();
    while start.elapsed() < budget {
        recent.clear();
        for _ in 0..32 {
            let b = damaged_body(&corpus, &mut rng);
            let mut packet = (b.len() as u32).to_be_bytes().to_vec();
            packet.extend_from_slice(&b);
            w.send_raw(&packet);
            recent.push(b);
            sent += 1;
        }
        // A barrier: the worker must still answer, in order.
        let seq = BARRIER + barriers;
        w.request(seq, "sync", &[], &[], nil());
        loop {
            let Some((reply, _)) = w.try_recv() else {
                let last: Vec<String> = recent.iter().map(|b| hex(b)).collect();
                panic!(
                    "the worker died (MOAT_FUZZ_SEED={seed}); last frames:\n{}",
                    last.join("\n")
                );
            };
            let items = reply.as_tuple().expect("replies are tuples");
            match (items[0].as_atom(), items[1].as_int()) {
                (Some("ok"), Some(s)) if s == seq as i128 => break,
                (Some("error"), _) => refusals += 1,
                (Some("ok"), _) => {}
                other => panic!("unexpected reply {reply} ({other:?})"),
            }
        }
        barriers += 1;
    }
    // Still computing correctly with fresh ids.
    let base = BARRIER;
    w.upload_f32(base, &[2], &[1.5, 2.5]);
    w.upload_f32(base + 1, &[2], &[1.0, 1.0]);
    w.request(0, "add", &[base + 2], &[base, base + 1], typed("f", 32));
    assert_eq!(w.read_f32(BARRIER - 1, base + 2), vec![2.5, 3.5]);
    assert!(
        w.close(std::time::Duration::from_secs(2)).success(),
        "the worker did not exit cleanly"
    );
    println!("real worker: {sent} damaged frames, {refusals} error replies, {barriers} barriers (seed {seed})");
    report::row(
        "malformed",
        "damaged frames sent to a real worker",
        sent,
        sent,
        0,
        &format!("{refusals} error replies; all {barriers} barrier calls answered in order; exit status 0"),
    );
}

#[test]
fn lying_lengths_cost_nothing() {
    // Counts of 2^32 - 1 elements, bytes, pairs and big-integer digits, each
    // followed by almost nothing.
    for input in [
        &[131, 108, 255, 255, 255, 255, 97, 1][..],
        &[131, 116, 255, 255, 255, 255, 97, 1, 97, 2],
        &[131, 109, 255, 255, 255, 255, 1],
        &[131, 105, 255, 255, 255, 255, 106],
        &[131, 107, 255, 255, 1, 2],
        &[131, 110, 255, 0, 1],
        &[131, 118, 255, 255, 97],
    ] {
        let (result, cost) = allocated_by(|| decode(input));
        assert!(result.is_err(), "{input:?} decoded");
        assert!(cost < 256, "{input:?} cost {cost} bytes");
    }
}

/// The graph ops of protocol.md's table, each with the attribute keys the
/// table lists for it.
fn graph_ops() -> Vec<(String, Vec<String>)> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../protocol.md")).unwrap();
    let ticked = |cell: &str| -> Vec<String> { cell.split('`').skip(1).step_by(2).map(str::to_string).collect() };
    let mut ops = Vec::new();
    for row in doc.lines().filter(|l| l.starts_with("| `:")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let keys: Vec<String> = ticked(cells.get(2).copied().unwrap_or(""))
            .into_iter()
            .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .collect();
        for op in ticked(cells[0]) {
            let name = op.trim_start_matches(':').to_string();
            if moat_port::ops::builder(&name).is_some() {
                ops.push((name, keys.clone()));
            }
        }
    }
    ops
}

/// A value for an op attribute, by its name: mostly small and plausible,
/// often at an edge (0, -1, a wrong length, a huge count), sometimes any term.
fn attr_value(key: &str, rng: &mut Rng) -> Term {
    let small = |rng: &mut Rng| -> Term {
        let edges = [-2i64, -1, 0, 1, 1, 2, 2, 3, 4, 1 << 16, i32::MAX as i64];
        Term::int(
            edges[if rng.chance(6) {
                rng.below(edges.len())
            } else {
                2 + rng.below(5)
            }],
        )
    };
    let list = |rng: &mut Rng| Term::List((0..rng.below(5)).map(|_| small(rng)).collect());
    if rng.chance(40) {
        return random_term(rng, 0);
    }
    let types = [
        ("f", 32),
        ("f", 64),
        ("f", 16),
        ("bf", 16),
        ("s", 32),
        ("s", 64),
        ("u", 8),
        ("c", 64),
        ("pred", 8),
    ];
    let atoms = |names: &[&str], rng: &mut Rng| Term::atom(names[rng.below(names.len())]);
    match key {
        "type" | "index_type" | "p_type" | "input_type" => {
            let (kind, bits) = types[rng.below(types.len())];
            ty(kind, bits)
        }
        "axis" if rng.chance(4) => nil(),
        "axis" | "k" | "length" | "batch_size" | "feature_group_size" | "batch_group_size" => small(rng),
        "padding" => Term::List(
            (0..rng.below(4))
                .map(|_| Term::tuple(vec![small(rng), small(rng)]))
                .collect(),
        ),
        "config" => Term::List(
            (0..rng.below(4))
                .map(|_| Term::List(vec![small(rng), small(rng), small(rng)]))
                .collect(),
        ),
        "starts" => Term::List(
            (0..rng.below(4))
                .map(|_| if rng.chance(3) { nil() } else { small(rng) })
                .collect(),
        ),
        "keep_axes" | "reverse" | "left_side" | "lower" | "full_matrices" | "equal_nan" => {
            atoms(&["true", "false"], rng)
        }
        "direction" => atoms(&["asc", "desc"], rng),
        "tie_break" => atoms(&["low", "high"], rng),
        "transform_a" => atoms(&["none", "transpose", "conjugate"], rng),
        "mode" => atoms(&["reduced", "complete"], rng),
        "leftover" => atoms(&["repeat", "discard"], rng),
        "eps" | "rtol" | "atol" => Term::Float([0.0, 1e-7, 1e-4, -1.0, f64::NAN][rng.below(5)]),
        "value" => Term::Binary((0..[1, 2, 4, 8][rng.below(4)]).map(|_| rng.next() as u8).collect()),
        _ => list(rng),
    }
}

/// How many outs an op defines (a wrong count is one more edge to try).
fn outs_of(op: &str, rng: &mut Rng) -> u64 {
    let usual = match op {
        "qr" | "eigh" | "top_k" => 2,
        "svd" | "lu" => 3,
        _ => 1,
    };
    if rng.chance(30) {
        rng.below(4) as u64
    } else {
        usual
    }
}

#[test]
fn a_worker_fed_ops_with_edge_case_attrs_fails_them_and_keeps_serving() {
    use moat_port::ops::Arity;
    let ops = graph_ops();
    assert!(ops.len() > 120, "protocol.md lists {} graph ops", ops.len());
    let (mut rng, seed) = Rng::seeded();
    let budget = report::fuzz_budget(2.0);
    let mut w = Worker::start_with(&["--log-level", "error"], Stdio::null());
    w.request(BARRIER, "set_memory_limit", &[], &[], Term::int(256 << 20));
    w.recv();
    // Inputs of several ranks and types; integers small enough to index.
    let f32s = |n: usize| {
        (0..n)
            .flat_map(|i| (i as f32 * 0.5 - 1.0).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let ints = |n: usize, bytes: usize| {
        (0..n)
            .flat_map(|i| ((i % 2) as u64).to_le_bytes()[..bytes].to_vec())
            .collect::<Vec<u8>>()
    };
    let mut pool: Vec<(&[i32], &str, u32, Vec<u8>)> = vec![
        (&[], "f", 32, f32s(1)),
        (&[3], "f", 32, f32s(3)),
        (&[2, 3], "f", 32, f32s(6)),
        (&[3, 3], "f", 32, f32s(9)),
        (&[1, 1, 4], "f", 32, f32s(4)),
        (&[2, 2, 2, 2], "f", 32, f32s(16)),
        (&[0], "f", 32, vec![]),
        (
            &[2, 2],
            "f",
            64,
            (0..4).flat_map(|i| (i as f64 + 1.0).to_le_bytes()).collect(),
        ),
        (&[3], "s", 32, ints(3, 4)),
        (&[2, 1], "s", 64, ints(2, 8)),
        (&[3, 2], "s", 64, ints(6, 8)),
        (&[2, 2], "u", 8, ints(4, 1)),
        (&[], "s", 32, ints(1, 4)),
        (&[2], "c", 64, f32s(4)),
        (&[2], "bf", 16, vec![0x80, 0x3f, 0x00, 0x40]),
        (&[2, 1], "f", 16, vec![0x00, 0x3c, 0x00, 0xc0]),
    ];
    let mut ids: Vec<u64> = (1..=pool.len() as u64).collect();
    for (id, (shape, kind, bits, bytes)) in ids.iter().zip(&pool) {
        w.upload(*id, shape, kind, *bits, bytes);
    }
    // Non-contiguous inputs: a transposed {3, 2} and a strided {2, 2} view of
    // the {3, 3} tensor, one left lazy and one evaluated.
    let views = [(&[3, 2][..], "transpose"), (&[2, 2], "slice")];
    let view_attrs = [
        map(vec![("axes", common::ints(&[1, 0]))]),
        map(vec![
            ("starts", common::ints(&[0, 0])),
            ("lengths", common::ints(&[3, 3])),
            ("strides", common::ints(&[2, 2])),
        ]),
    ];
    for (((shape, op), attrs), input) in views.iter().zip(view_attrs).zip([3, 4]) {
        let id = ids.len() as u64 + 1;
        w.request(0, op, &[id], &[input], attrs);
        ids.push(id);
        pool.push((shape, "f", 32, vec![]));
    }
    w.request(BARRIER - 1, "eval", &[], &[ids.len() as u64], nil());
    w.recv();
    let start = Instant::now();
    let (mut next_id, mut seq) = (1000u64, 1u64);
    let (mut computed, mut failed) = (0u64, 0u64);
    while start.elapsed() < budget {
        let (op, keys) = rng.pick(&ops);
        let inputs = match moat_port::ops::builder(op).unwrap().0 {
            Arity::Exactly(k) => k,
            Arity::AtLeast(k) => k + rng.below(3),
        };
        let ins: Vec<u64> = (0..inputs).map(|_| *rng.pick(&ids)).collect();
        let mut pairs: Vec<(&str, Term)> = Vec::new();
        for key in keys {
            if !rng.chance(25) {
                pairs.push((key.as_str(), attr_value(key, &mut rng)));
            }
        }
        let attrs = map(pairs);
        let outs: Vec<u64> = (next_id..next_id + outs_of(op, &mut rng)).collect();
        next_id += outs.len() as u64 + 1;
        // An op that moves its first input out of its id (kv_write) would
        // spend a pool tensor eagerly; as a program's step it copies instead.
        let moves = moat_port::ops::MOVES_FIRST_INPUT.contains(&op.as_str());
        let program = (moves || rng.chance(50)).then(|| {
            next_id += 1;
            next_id
        });
        match program {
            // The same op as the one step of a program, defined and run.
            Some(id) => {
                let (n_in, n_out) = (ins.len() as u64, outs.len() as u64);
                let slots = |r: std::ops::Range<u64>| Term::List(r.map(Term::int).collect());
                let step = Term::tuple(vec![
                    Term::atom(op),
                    slots(0..n_in),
                    slots(n_in..n_in + n_out),
                    attrs.clone(),
                ]);
                let definition = map(vec![
                    ("id", Term::int(id)),
                    ("slots", Term::int(n_in + n_out)),
                    ("inputs", slots(0..n_in)),
                    ("outputs", slots(n_in..n_in + n_out)),
                    ("steps", Term::List(vec![step])),
                ]);
                w.request(0, "define_program", &[], &[], definition);
                w.request(0, "run_program", &outs, &ins, Term::int(id));
                w.request(0, "release_program", &[], &[], Term::List(vec![Term::int(id)]));
            }
            None => w.request(0, op, &outs, &ins, attrs.clone()),
        }
        w.request(seq, "eval", &[], &outs, nil());
        loop {
            let Some((reply, _)) = w.try_recv() else {
                let shapes: Vec<_> = ins.iter().map(|i| &pool[*i as usize - 1].0).collect();
                panic!("the worker died on {op} of {shapes:?} with {attrs} (MOAT_FUZZ_SEED={seed})");
            };
            let items = reply.as_tuple().expect("replies are tuples");
            match (items[0].as_atom(), items[1].as_int()) {
                (Some("ok"), Some(s)) if s == seq as i128 => computed += 1,
                (Some("error"), Some(s)) if s == seq as i128 => failed += 1,
                _ => continue,
            }
            break;
        }
        w.request(0, "release", &[], &outs, nil());
        seq += 1;
    }
    w.request(0, "add", &[next_id], &[2, 2], typed("f", 32));
    assert_eq!(w.read_f32(BARRIER + 1, next_id), vec![-2.0, -1.0, 0.0]);
    assert!(w.close(std::time::Duration::from_secs(2)).success());
    let runs = computed + failed;
    println!(
        "edge-case ops: {runs} ({computed} computed, {failed} failed cleanly) in {:?} (seed {seed})",
        start.elapsed()
    );
    report::row(
        "malformed",
        "graph ops with edge-case attributes and inputs (real worker)",
        runs,
        runs,
        0,
        &format!("{computed} computed, {failed} failed with an error; each evaluated"),
    );
}
