//! The subset of Erlang's external term format (ETF) that frame headers use.
//!
//! Headers are small control terms (integers, floats, atoms, binaries, tuples,
//! lists, maps); tensor bytes never travel inside them. The decoder is
//! hand-written so that every length is checked against the bytes actually
//! present before anything is allocated: a hostile or corrupt header costs at
//! most its own size.

use std::fmt;

const VERSION: u8 = 131;
const NEW_FLOAT_EXT: u8 = 70;
const SMALL_INTEGER_EXT: u8 = 97;
const INTEGER_EXT: u8 = 98;
const ATOM_EXT: u8 = 100;
const SMALL_TUPLE_EXT: u8 = 104;
const LARGE_TUPLE_EXT: u8 = 105;
const NIL_EXT: u8 = 106;
const STRING_EXT: u8 = 107;
const LIST_EXT: u8 = 108;
const BINARY_EXT: u8 = 109;
const SMALL_BIG_EXT: u8 = 110;
const SMALL_ATOM_EXT: u8 = 115;
const MAP_EXT: u8 = 116;
const ATOM_UTF8_EXT: u8 = 118;
const SMALL_ATOM_UTF8_EXT: u8 = 119;

/// Nesting deeper than this is refused (headers are a few levels deep).
const MAX_DEPTH: usize = 64;

#[derive(Clone, Debug, PartialEq)]
pub enum Term {
    /// Integers that fit in an i128 (covers the whole u64 and i64 ranges).
    Int(i128),
    Float(f64),
    Atom(String),
    Binary(Vec<u8>),
    Tuple(Vec<Term>),
    /// Proper lists; `[]` is an empty `List`.
    List(Vec<Term>),
    Map(Vec<(Term, Term)>),
}

/// Why a packet could not be read: its framing (lengths, batches) or its
/// header term. The message names which; only the term decoder's say
/// "bad header term".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}

fn err<T>(msg: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(format!("bad header term: {}", msg.into())))
}

impl Term {
    pub fn atom(name: &str) -> Term {
        Term::Atom(name.to_string())
    }

    pub fn tuple(items: impl Into<Vec<Term>>) -> Term {
        Term::Tuple(items.into())
    }

    pub fn int(v: impl Into<i128>) -> Term {
        Term::Int(v.into())
    }

    pub fn nil() -> Term {
        Term::List(Vec::new())
    }

    pub fn as_atom(&self) -> Option<&str> {
        match self {
            Term::Atom(a) => Some(a),
            _ => None,
        }
    }

    pub fn is_atom(&self, name: &str) -> bool {
        self.as_atom() == Some(name)
    }

    pub fn as_int(&self) -> Option<i128> {
        match self {
            Term::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_list(&self) -> Option<&[Term]> {
        match self {
            Term::List(l) => Some(l),
            _ => None,
        }
    }

    pub fn as_tuple(&self) -> Option<&[Term]> {
        match self {
            Term::Tuple(t) => Some(t),
            _ => None,
        }
    }

    /// Looks a key up in a map term, or in a keyword list (`[{key, value}]`).
    pub fn get(&self, key: &str) -> Option<&Term> {
        match self {
            Term::Map(pairs) => pairs.iter().find(|(k, _)| k.is_atom(key)).map(|(_, v)| v),
            Term::List(items) => items.iter().find_map(|item| match item.as_tuple() {
                Some([k, v]) if k.is_atom(key) => Some(v),
                _ => None,
            }),
            _ => None,
        }
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn seq(f: &mut fmt::Formatter<'_>, items: &[Term]) -> fmt::Result {
            for (i, t) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{t}")?;
            }
            Ok(())
        }
        match self {
            Term::Int(i) => write!(f, "{i}"),
            Term::Float(x) => write!(f, "{x:?}"),
            Term::Atom(a) if matches!(a.as_str(), "nil" | "true" | "false") => f.write_str(a),
            Term::Atom(a) => write!(f, ":{a}"),
            Term::Binary(b) => write!(f, "{:?}", String::from_utf8_lossy(b)),
            Term::Tuple(t) => {
                f.write_str("{")?;
                seq(f, t)?;
                f.write_str("}")
            }
            Term::List(l) => {
                f.write_str("[")?;
                seq(f, l)?;
                f.write_str("]")
            }
            Term::Map(pairs) => {
                f.write_str("%{")?;
                for (i, (k, v)) in pairs.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    match k {
                        Term::Atom(a) => write!(f, "{a}: {v}")?,
                        _ => write!(f, "{k} => {v}")?,
                    }
                }
                f.write_str("}")
            }
        }
    }
}

/// Decodes one complete term (with its leading version byte). Trailing bytes
/// are an error: a header is exactly one term.
pub fn decode(bytes: &[u8]) -> Result<Term, DecodeError> {
    let mut r = Reader { bytes, pos: 0 };
    if r.u8()? != VERSION {
        return err("missing version byte 131");
    }
    let term = r.term(0)?;
    if r.pos != bytes.len() {
        return err(format!("{} trailing bytes", bytes.len() - r.pos));
    }
    Ok(term)
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.bytes.len() - self.pos {
            return err(format!("truncated: wanted {n} bytes at offset {}", self.pos));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<usize, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]) as usize)
    }

    fn u32(&mut self) -> Result<usize, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    /// Every element takes at least one byte, so a count larger than what is
    /// left is a lie; checking it first bounds every allocation.
    fn count(&mut self, n: usize, min_bytes_each: usize) -> Result<usize, DecodeError> {
        if n.saturating_mul(min_bytes_each) > self.bytes.len() - self.pos {
            return err(format!(
                "length {n} exceeds the remaining {} bytes",
                self.bytes.len() - self.pos
            ));
        }
        Ok(n)
    }

    fn atom_text(&mut self, n: usize) -> Result<Term, DecodeError> {
        let raw = self.take(n)?;
        // ATOM_EXT is Latin-1; headers only use ASCII atoms, so both encodings
        // are read as UTF-8 and anything else is refused.
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(Term::Atom(s.to_string())),
            Err(_) => err("atom is not valid UTF-8"),
        }
    }

    fn term(&mut self, depth: usize) -> Result<Term, DecodeError> {
        if depth > MAX_DEPTH {
            return err("nesting too deep");
        }
        let tag = self.u8()?;
        match tag {
            SMALL_INTEGER_EXT => Ok(Term::Int(self.u8()? as i128)),
            INTEGER_EXT => {
                let b = self.take(4)?;
                Ok(Term::Int(i32::from_be_bytes([b[0], b[1], b[2], b[3]]) as i128))
            }
            SMALL_BIG_EXT => {
                let n = self.u8()? as usize;
                let sign = self.u8()?;
                let digits = self.take(n)?;
                if n > 16 {
                    return err("integer wider than 128 bits");
                }
                let mut v: u128 = 0;
                for (i, d) in digits.iter().enumerate() {
                    v |= (*d as u128) << (8 * i);
                }
                if v > i128::MAX as u128 {
                    return err("integer out of range");
                }
                Ok(Term::Int(if sign == 0 { v as i128 } else { -(v as i128) }))
            }
            NEW_FLOAT_EXT => {
                let b = self.take(8)?;
                Ok(Term::Float(f64::from_be_bytes(b.try_into().expect("8 bytes"))))
            }
            ATOM_EXT | ATOM_UTF8_EXT => {
                let n = self.u16()?;
                self.atom_text(n)
            }
            SMALL_ATOM_EXT | SMALL_ATOM_UTF8_EXT => {
                let n = self.u8()? as usize;
                self.atom_text(n)
            }
            SMALL_TUPLE_EXT => {
                let n = self.u8()? as usize;
                self.items(n, depth).map(Term::Tuple)
            }
            LARGE_TUPLE_EXT => {
                let n = self.u32()?;
                self.items(n, depth).map(Term::Tuple)
            }
            NIL_EXT => Ok(Term::List(Vec::new())),
            STRING_EXT => {
                // term_to_binary writes lists of small integers (shapes!) this way.
                let n = self.u16()?;
                Ok(Term::List(
                    self.take(n)?.iter().map(|b| Term::Int(*b as i128)).collect(),
                ))
            }
            LIST_EXT => {
                let n = self.u32()?;
                let items = self.items(n, depth)?;
                if self.u8()? != NIL_EXT {
                    return err("improper list");
                }
                Ok(Term::List(items))
            }
            BINARY_EXT => {
                let n = self.u32()?;
                Ok(Term::Binary(self.take(n)?.to_vec()))
            }
            MAP_EXT => {
                let n = self.u32()?;
                let n = self.count(n, 2)?;
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    let k = self.term(depth + 1)?;
                    let v = self.term(depth + 1)?;
                    pairs.push((k, v));
                }
                Ok(Term::Map(pairs))
            }
            other => err(format!("unsupported term tag {other}")),
        }
    }

    fn items(&mut self, n: usize, depth: usize) -> Result<Vec<Term>, DecodeError> {
        let n = self.count(n, 1)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.term(depth + 1)?);
        }
        Ok(items)
    }
}

/// Encodes a term with its version byte, the way `:erlang.binary_to_term/1`
/// reads it.
pub fn encode(term: &Term) -> Vec<u8> {
    let mut out = vec![VERSION];
    encode_into(term, &mut out);
    out
}

fn encode_into(term: &Term, out: &mut Vec<u8>) {
    match term {
        Term::Int(i) => encode_int(*i, out),
        Term::Float(x) => {
            out.push(NEW_FLOAT_EXT);
            out.extend_from_slice(&x.to_be_bytes());
        }
        Term::Atom(a) => {
            let bytes = a.as_bytes();
            if bytes.len() < 256 {
                out.push(SMALL_ATOM_UTF8_EXT);
                out.push(bytes.len() as u8);
            } else {
                out.push(ATOM_UTF8_EXT);
                out.extend_from_slice(&(bytes.len().min(u16::MAX as usize) as u16).to_be_bytes());
            }
            out.extend_from_slice(&bytes[..bytes.len().min(u16::MAX as usize)]);
        }
        Term::Binary(b) => {
            out.push(BINARY_EXT);
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(b);
        }
        Term::Tuple(items) => {
            if items.len() < 256 {
                out.push(SMALL_TUPLE_EXT);
                out.push(items.len() as u8);
            } else {
                out.push(LARGE_TUPLE_EXT);
                out.extend_from_slice(&(items.len() as u32).to_be_bytes());
            }
            items.iter().for_each(|t| encode_into(t, out));
        }
        Term::List(items) if items.is_empty() => out.push(NIL_EXT),
        Term::List(items) if is_byte_string(items) => {
            // What term_to_binary writes for such lists, so both sides agree byte for byte.
            out.push(STRING_EXT);
            out.extend_from_slice(&(items.len() as u16).to_be_bytes());
            out.extend(items.iter().filter_map(|t| t.as_int().map(|i| i as u8)));
        }
        Term::List(items) => {
            out.push(LIST_EXT);
            out.extend_from_slice(&(items.len() as u32).to_be_bytes());
            items.iter().for_each(|t| encode_into(t, out));
            out.push(NIL_EXT);
        }
        Term::Map(pairs) => {
            out.push(MAP_EXT);
            out.extend_from_slice(&(pairs.len() as u32).to_be_bytes());
            for (k, v) in pairs {
                encode_into(k, out);
                encode_into(v, out);
            }
        }
    }
}

fn is_byte_string(items: &[Term]) -> bool {
    items.len() <= u16::MAX as usize && items.iter().all(|t| matches!(t, Term::Int(0..=255)))
}

fn encode_int(i: i128, out: &mut Vec<u8>) {
    if (0..=255).contains(&i) {
        out.push(SMALL_INTEGER_EXT);
        out.push(i as u8);
    } else if (i32::MIN as i128..=i32::MAX as i128).contains(&i) {
        out.push(INTEGER_EXT);
        out.extend_from_slice(&(i as i32).to_be_bytes());
    } else {
        let mut mag = i.unsigned_abs();
        let mut digits = Vec::with_capacity(16);
        while mag > 0 {
            digits.push((mag & 0xff) as u8);
            mag >>= 8;
        }
        out.push(SMALL_BIG_EXT);
        out.push(digits.len() as u8);
        out.push(u8::from(i < 0));
        out.extend_from_slice(&digits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let t = Term::tuple(vec![
            Term::int(7),
            Term::int(-1),
            Term::int(u64::MAX),
            Term::int(i64::MIN),
            Term::Float(1.5),
            Term::atom("add"),
            Term::List(vec![Term::int(300), Term::nil()]),
            Term::Binary(b"xy".to_vec()),
            Term::Map(vec![(Term::atom("k"), Term::int(1))]),
        ]);
        assert_eq!(decode(&encode(&t)).unwrap(), t);
    }

    #[test]
    fn string_ext_is_a_list_of_small_ints() {
        // :erlang.term_to_binary([2, 3])
        assert_eq!(
            decode(&[131, 107, 0, 2, 2, 3]).unwrap(),
            Term::List(vec![Term::int(2), Term::int(3)])
        );
    }

    #[test]
    fn lying_lengths_are_refused_without_allocating() {
        assert!(decode(&[131, 108, 255, 255, 255, 255]).is_err());
        assert!(decode(&[131, 116, 255, 255, 255, 255]).is_err());
        assert!(decode(&[131, 109, 255, 255, 255, 255, 1]).is_err());
    }

    #[test]
    fn trailing_bytes_and_deep_nesting_are_refused() {
        assert!(decode(&[131, 97, 1, 0]).is_err());
        let mut deep = vec![131];
        deep.extend(std::iter::repeat_n([104u8, 1], 100).flatten());
        deep.extend([97, 1]);
        assert!(decode(&deep).is_err());
    }
}
