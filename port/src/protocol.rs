//! The typed side of protocol.md: request headers in, reply headers out.

use crate::failure::{Failure, Kind};
use crate::mlx::Dtype;
use crate::term::Term;

pub const VERSION: i128 = 1;

/// The op that an upload's failures name, whichever way its bytes travel
/// (`upload_file` and `from_file` included): a caller sees the same
/// error for the same upload.
pub const FROM_BINARY: &str = "from_binary";

/// A tensor id, chosen by the client.
pub type Id = u64;

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub seq: u64,
    pub generation: u64,
    pub op: String,
    pub outs: Vec<Id>,
    pub ins: Vec<Id>,
    pub attrs: Term,
}

/// A header that is not a well-formed request, or a request refused as a
/// whole before it reaches the session. Whatever could be read of it is kept
/// so the failure can still reach the caller and poison its outputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Malformed {
    pub seq: u64,
    pub outs: Vec<Id>,
    pub failure: Failure,
}

impl Request {
    pub fn parse(header: Term) -> Result<Request, Malformed> {
        let items = match header {
            Term::Tuple(items) => items,
            other => {
                return Err(malformed(
                    0,
                    "protocol",
                    vec![],
                    format!("request must be a tuple, got {other}"),
                ))
            }
        };
        let seq = items.first().and_then(as_u64).unwrap_or(0);
        let op = items.get(2).and_then(Term::as_atom).unwrap_or("protocol").to_string();
        let outs = items.get(3).and_then(|t| ids(t).ok()).unwrap_or_default();
        if items.len() != 6 {
            let message = format!(
                "request must be {{seq, generation, op, outs, ins, attrs}}, got a {}-tuple",
                items.len()
            );
            return Err(malformed(seq, &op, outs, message));
        }
        let fail = |message: String| Err(malformed(seq, &op, outs.clone(), message));
        let Some(seq) = as_u64(&items[0]) else {
            return fail(format!("seq must be a non-negative integer, got {}", items[0]));
        };
        let Some(generation) = as_u64(&items[1]) else {
            return fail(format!("bad generation {}", items[1]));
        };
        if items[2].as_atom().is_none() {
            return fail(format!("op must be an atom, got {}", items[2]));
        }
        let outs = match ids(&items[3]) {
            Ok(v) => v,
            Err(m) => return fail(format!("outs: {m}")),
        };
        let ins = match ids(&items[4]) {
            Ok(v) => v,
            Err(m) => return fail(format!("ins: {m}")),
        };
        let attrs = items.into_iter().nth(5).expect("6 items");
        Ok(Request {
            seq,
            generation,
            op,
            outs,
            ins,
            attrs,
        })
    }
}

fn malformed(seq: u64, op: &str, outs: Vec<Id>, message: String) -> Malformed {
    Malformed {
        seq,
        outs,
        failure: Failure::protocol(op, message),
    }
}

fn as_u64(t: &Term) -> Option<u64> {
    t.as_int().and_then(|i| u64::try_from(i).ok())
}

fn ids(t: &Term) -> Result<Vec<Id>, String> {
    let list = t.as_list().ok_or_else(|| format!("expected a list of ids, got {t}"))?;
    list.iter()
        .map(|x| {
            as_u64(x)
                .filter(|id| *id > 0)
                .ok_or_else(|| format!("bad tensor id {x}"))
        })
        .collect()
}

pub fn hello(info: Vec<(&str, Term)>) -> Term {
    let map = info.into_iter().map(|(k, v)| (Term::atom(k), v)).collect();
    Term::tuple(vec![Term::atom("hello"), Term::Int(VERSION), Term::Map(map)])
}

pub fn ack(processed: u64) -> Term {
    Term::tuple(vec![Term::atom("ack"), Term::int(processed)])
}

pub fn ok(seq: u64, result: Term) -> Term {
    Term::tuple(vec![Term::atom("ok"), Term::int(seq), result])
}

/// The work the worker has done so far (µs of CPU time, plus the GPU's busy
/// time on a GPU worker): the client's watchdog tells a long computation (it
/// grows) from a hung worker (it does not).
pub fn progress(work_us: u64) -> Term {
    Term::tuple(vec![Term::atom("progress"), Term::int(work_us)])
}

pub fn memory_pressure(active: usize) -> Term {
    Term::tuple(vec![Term::atom("memory_pressure"), Term::int(active as u64)])
}

/// `{:hook, seq, info}`: one value of a hook firing of run `seq`, its bytes
/// the payload (after `{:more, seq}` chunks when they exceed one).
pub fn hook(seq: u64, info: Term) -> Term {
    Term::tuple(vec![Term::atom("hook"), Term::int(seq), info])
}

pub fn more(seq: u64) -> Term {
    Term::tuple(vec![Term::atom("more"), Term::int(seq)])
}

/// `{:error, seq, op, %{kind: kind, message: binary, ...}}`: the kind's
/// fields join the map (§4).
pub fn error(seq: u64, failure: &Failure) -> Term {
    let mut fields = vec![
        ("kind", Term::atom(failure.kind.name())),
        ("message", Term::Binary(failure.message.as_bytes().to_vec())),
    ];
    if let Kind::MemoryLimit { need, in_use, limit } = failure.kind {
        fields.push(("need", Term::int(need as u64)));
        fields.push(("in_use", Term::int(in_use as u64)));
        fields.push(("limit", Term::int(limit as u64)));
    }
    Term::tuple(vec![
        Term::atom("error"),
        Term::int(seq),
        Term::atom(&failure.op),
        map(fields),
    ])
}

/// A map with atom keys, sorted the way OTP writes small maps.
pub fn map(mut pairs: Vec<(&str, Term)>) -> Term {
    pairs.sort_by(|a, b| a.0.cmp(b.0));
    Term::Map(pairs.into_iter().map(|(k, v)| (Term::atom(k), v)).collect())
}

/// A type as the wire spells it, Nx's `{kind, bits}` (§6).
pub fn dtype(t: &Term) -> Option<Dtype> {
    match t.as_tuple()? {
        [kind, bits] => Dtype::from_nx(kind.as_atom()?, bits.as_int()?),
        _ => None,
    }
}

pub fn dtype_term(dtype: Dtype) -> Term {
    let (k, b) = dtype.nx();
    Term::tuple(vec![Term::atom(k), Term::int(b)])
}

pub fn shape_term(shape: &[i32]) -> Term {
    Term::List(shape.iter().map(|d| Term::int(*d)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::term::decode;

    #[test]
    fn parses_a_request() {
        // {0, 3, :add, [7], [5, 6], nil}
        let bytes = [
            0x83, 0x68, 0x06, 0x61, 0x00, 0x61, 0x03, 0x77, 0x03, 0x61, 0x64, 0x64, 0x6b, 0x00, 0x01, 0x07, 0x6b, 0x00,
            0x02, 0x05, 0x06, 0x77, 0x03, 0x6e, 0x69, 0x6c,
        ];
        let req = Request::parse(decode(&bytes).unwrap()).unwrap();
        assert_eq!((req.seq, req.generation, req.op.as_str()), (0, 3, "add"));
        assert_eq!((req.outs, req.ins), (vec![7], vec![5, 6]));
    }

    #[test]
    fn failures_are_maps_of_kind_message_and_the_kind_s_fields() {
        let exceeded = crate::budget::Exceeded {
            need: 8,
            in_use: 1,
            limit: 4,
        };
        let cases = [
            (Failure::invalid("add", "bad"), "%{kind: :invalid, message: \"bad\"}"),
            (Failure::mlx("eval", crate::mlx::Error::new("raised")), "%{kind: :mlx, message: \"raised\"}"),
            (
                Failure::memory_limit("eval", &exceeded),
                "%{in_use: 1, kind: :memory_limit, limit: 4, message: \"memory limit exceeded: needs 8 bytes, 1 bytes in use, limit 4 bytes\", need: 8}",
            ),
            (
                Failure::stale_generation(2, 3, "sync"),
                "%{kind: :stale_generation, message: \"sync was sent to worker generation 2 but this worker is generation 3\"}",
            ),
            (Failure::protocol("protocol", "short"), "%{kind: :protocol, message: \"short\"}"),
            (Failure::system("from_binary", "no fd"), "%{kind: :system, message: \"no fd\"}"),
        ];
        for (failure, expected) in cases {
            let term = error(7, &failure);
            assert_eq!(term.to_string(), format!("{{:error, 7, :{}, {expected}}}", failure.op));
        }
    }

    #[test]
    fn malformed_requests_keep_what_can_be_read() {
        let t = Term::tuple(vec![
            Term::int(4),
            Term::int(1),
            Term::atom("add"),
            Term::List(vec![Term::int(9)]),
        ]);
        let m = Request::parse(t).unwrap_err();
        assert_eq!((m.seq, m.failure.op.as_str(), m.outs), (4, "add", vec![9]));
        let t = Term::tuple(vec![
            Term::int(4),
            Term::int(1),
            Term::atom("add"),
            Term::nil(),
            Term::List(vec![Term::int(0)]),
            Term::nil(),
        ]);
        assert!(Request::parse(t)
            .unwrap_err()
            .failure
            .message
            .contains("bad tensor id 0"));
    }
}
