//! protocol.md's examples, checked against the Rust codec: each example's
//! bytes decode to the term it shows and re-encode to the same bytes.

use moat_port::frame::{FrameReader, Limits};
use moat_port::term::{decode, encode};

struct Example {
    title: String,
    term: String,
    hex: String,
}

fn examples() -> Vec<Example> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../protocol.md")).expect("protocol.md");
    let section = doc.split("## 7. Examples").nth(1).expect("an Examples section");
    let mut out = Vec::new();
    for part in section.split("### Example: ").skip(1) {
        let title = part.lines().next().unwrap().to_string();
        let block = |lang: &str| {
            let start = part
                .find(&format!("```{lang}\n"))
                .unwrap_or_else(|| panic!("{title}: no {lang} block"));
            let body = &part[start + lang.len() + 4..];
            body[..body.find("```").unwrap()].to_string()
        };
        out.push(Example {
            term: block("term").trim().to_string(),
            hex: block("hex"),
            title,
        });
    }
    out
}

fn unhex(s: &str) -> Vec<u8> {
    let digits: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn every_example_decodes_to_its_term_and_reencodes_to_its_bytes() {
    let examples = examples();
    assert!(examples.len() >= 10, "found only {} examples", examples.len());
    for ex in examples {
        let bytes = unhex(&ex.hex);
        let term = decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", ex.title));
        assert_eq!(term.to_string(), ex.term, "{}: decoded term differs", ex.title);
        assert_eq!(encode(&term), bytes, "{}: re-encoded bytes differ", ex.title);
    }
}

fn block<'a>(doc: &'a str, lang: &str) -> &'a str {
    let start = doc
        .find(&format!("```{lang}\n"))
        .unwrap_or_else(|| panic!("no {lang} block"))
        + lang.len()
        + 4;
    &doc[start..start + doc[start..].find("```").unwrap()]
}

#[test]
fn the_batch_example_reads_as_its_frames() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../protocol.md")).expect("protocol.md");
    let terms: Vec<&str> = block(&doc, "batch").lines().filter(|l| !l.trim().is_empty()).collect();
    let bytes = unhex(block(&doc, "batch-hex"));
    let mut reader = FrameReader::new(&bytes[..], Limits::default());
    let mut read = Vec::new();
    while let Some(head) = reader.next_head().unwrap() {
        assert_eq!(head.payload_len, 0);
        read.push(head.header.expect("a frame of the batch").to_string());
    }
    assert_eq!(terms.len(), 2);
    assert_eq!(read, terms);
}

/// §1's malformed-batch rule, on its example: the reader yields exactly the
/// frames and refusals the document lists, in order, and then the stream is
/// at its end (the dropped rest was consumed, not read as frames).
#[test]
fn the_malformed_batch_example_reads_as_documented() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../protocol.md")).expect("protocol.md");
    let expected: Vec<&str> = block(&doc, "batch-malformed")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    let bytes = unhex(block(&doc, "batch-malformed-hex"));
    let mut reader = FrameReader::new(&bytes[..], Limits::default());
    let mut read = Vec::new();
    while let Some(head) = reader.next_head().unwrap() {
        read.push(match head.header {
            Ok(term) => term.to_string(),
            Err(e) => format!("refused: {}", e.0),
        });
    }
    assert_eq!(expected.len(), 3);
    assert_eq!(read, expected);
}
