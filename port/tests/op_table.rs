//! One op list per side, checked both ways: the ops the worker knows
//! (`moat_port --list-ops`: its requests and its op table) are exactly those
//! protocol.md §6 documents, and the worker serves each one it lists. (The
//! Elixir side checks that every op the client can send is in the list.)

mod common;

use common::{error_parts, nil, Worker};
use std::collections::BTreeSet;
use std::process::Command;

/// The op names of protocol.md §6's tables (the first column's `:name`s).
fn documented() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../protocol.md")).unwrap();
    let start = doc.find("## 6. Operations").expect("a section 6");
    let end = doc.find("## 7. Examples").expect("a section 7");
    let mut ops = BTreeSet::new();
    for row in doc[start..end].lines().filter(|l| l.starts_with("| `:")) {
        let first = row.split(" | ").next().unwrap();
        for ticked in first.split('`').skip(1).step_by(2) {
            if let Some(name) = ticked.strip_prefix(':') {
                ops.insert(name.to_string());
            }
        }
    }
    ops
}

fn listed() -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_moat_port"))
        .arg("--list-ops")
        .output()
        .expect("run moat_port --list-ops");
    assert!(out.status.success(), "--list-ops: {:?}", out);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn the_worker_knows_exactly_the_ops_protocol_md_documents() {
    let doc = documented();
    let list = listed();
    let known: BTreeSet<String> = list.iter().cloned().collect();
    assert_eq!(known.len(), list.len(), "--list-ops names an op twice: {list:?}");
    assert!(doc.len() > 130, "protocol.md §6 documents {} ops", doc.len());
    let undocumented: Vec<_> = known.difference(&doc).collect();
    let unknown: Vec<_> = doc.difference(&known).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "the worker knows ops protocol.md §6 lacks: {undocumented:?}; \
         protocol.md §6 documents ops the worker does not know: {unknown:?}"
    );
}

#[test]
fn the_worker_serves_every_op_it_lists() {
    let mut w = Worker::start(&["--log-level", "error"]);
    for (seq, op) in (1..).zip(listed()) {
        // Whatever else is wrong with this request (no inputs, no outs, no
        // attrs), its op must be one the worker dispatches.
        w.request(seq, &op, &[], &[], nil());
        let (reply, _) = w.recv();
        let tuple = reply.as_tuple().expect("a tuple");
        assert!(tuple[1].as_int() == Some(seq as i128), "{op}: reply {reply}");
        if tuple[0].is_atom("error") {
            let (failed, message) = error_parts(&reply);
            assert!(
                !message.contains("unknown op"),
                "{op} is listed but unknown: {failed}: {message}"
            );
        }
    }
}
