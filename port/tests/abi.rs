//! The C ABI, checked mechanically: every prototype of port/shim/moat_shim.h
//! has a declaration in port/src/mlx/ffi.rs with the same name, arity,
//! parameter types and return type (C types mapped to Rust's), and the other
//! way round; the shim's dtype codes are the order of `Dtype`. A drift here
//! would be undefined behaviour at run time, so it fails this test instead.

use moat_port::mlx::Dtype;
use std::collections::BTreeMap;

const HEADER: &str = include_str!("../shim/moat_shim.h");
const FFI: &str = include_str!("../src/mlx/ffi.rs");

/// A signature in Rust's spelling: parameter types, then the return type
/// (`()` for none).
type Signature = (Vec<String>, String);

#[test]
fn the_header_and_ffi_rs_declare_the_same_functions() {
    let c = header_functions();
    let rust = rust_functions();
    assert!(c.len() > 100, "found {} prototypes in moat_shim.h", c.len());
    let only_c: Vec<_> = c.keys().filter(|k| !rust.contains_key(*k)).collect();
    let only_rust: Vec<_> = rust.keys().filter(|k| !c.contains_key(*k)).collect();
    assert!(
        only_c.is_empty() && only_rust.is_empty(),
        "declared in moat_shim.h only: {only_c:?}; in ffi.rs only: {only_rust:?}"
    );
    let drifted: Vec<String> = c
        .iter()
        .filter(|(name, sig)| rust[*name] != **sig)
        .map(|(name, sig)| format!("{name}: moat_shim.h says {sig:?}, ffi.rs says {:?}", rust[name]))
        .collect();
    assert!(drifted.is_empty(), "signatures differ:\n{}", drifted.join("\n"));
}

#[test]
fn the_status_codes_and_dtype_codes_agree() {
    let defined = |name: &str| {
        HEADER
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .map(|v| v.trim().to_string())
    };
    let rust_ok = FFI
        .lines()
        .find_map(|l| l.trim().strip_prefix("pub const MOAT_OK: c_int = "))
        .map(|v| v.trim_end_matches(';').to_string());
    assert_eq!(defined("MOAT_OK"), rust_ok, "MOAT_OK");

    let start = HEADER.find("enum moat_dtype {").expect("enum moat_dtype");
    let body = &HEADER[start + "enum moat_dtype {".len()..];
    let body = &body[..body.find('}').unwrap()];
    let names: Vec<String> = body
        .split(',')
        .map(|n| n.trim().trim_start_matches("MOAT_").to_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    for (code, name) in names.iter().enumerate() {
        let dtype = Dtype::from_code(code as i32).unwrap_or_else(|| panic!("no Dtype for code {code} ({name})"));
        assert_eq!(&format!("{dtype:?}").to_lowercase(), name, "dtype code {code}");
    }
    assert!(
        Dtype::from_code(names.len() as i32).is_none(),
        "Dtype has codes the shim lacks"
    );
}

#[test]
fn c_types_map_to_rust_types() {
    let param = |s: &str| c_param(s);
    assert_eq!(param("const moat_array* const* arrays"), "*const *const moat_array");
    assert_eq!(param("moat_array* const* arrays"), "*const *mut moat_array");
    assert_eq!(param("moat_array** out"), "*mut *mut moat_array");
    assert_eq!(param("const int32_t* shape"), "*const i32");
    assert_eq!(param("void (*release)(void*)"), "extern \"C\" fn(*mut c_void)");
    assert_eq!(param("size_t n"), "usize");
}

/// Prototypes of moat_shim.h, by name.
fn header_functions() -> BTreeMap<String, Signature> {
    let text = strip_c_comments(HEADER);
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = BTreeMap::new();
    for decl in text.split(';') {
        let decl = decl.trim().trim_start_matches("extern \"C\" {").trim();
        let (Some(open), false) = (decl.find('('), decl.contains("typedef") || decl.contains('{')) else {
            continue;
        };
        let head = decl[..open].trim();
        let Some((ret, name)) = head.rsplit_once(|c: char| c.is_whitespace() || c == '*') else {
            continue;
        };
        let ret = head[..ret.len() + 1].trim();
        let params = &decl[open + 1..decl.rfind(')').expect("a closing parenthesis")];
        let params = split_top_level(params)
            .into_iter()
            .filter(|p| p != "void" && !p.is_empty())
            .map(|p| c_param(&p))
            .collect();
        let ret = if ret == "void" { "()".to_string() } else { c_type(ret) };
        out.insert(name.trim().to_string(), (params, ret));
    }
    out
}

/// One C parameter's type in Rust's spelling (its name dropped).
fn c_param(p: &str) -> String {
    if let Some(star) = p.find("(*") {
        // A function pointer: `ret (*name)(params)`.
        let ret = p[..star].trim();
        let args = &p[p.rfind('(').unwrap() + 1..p.rfind(')').unwrap()];
        let args: Vec<String> = split_top_level(args)
            .into_iter()
            .filter(|a| a != "void")
            .map(|a| c_type(&a))
            .collect();
        let ret = if ret == "void" {
            String::new()
        } else {
            format!(" -> {}", c_type(ret))
        };
        return format!("extern \"C\" fn({}){ret}", args.join(", "));
    }
    // The name is the last identifier (every parameter of the header has one).
    let p = p.trim();
    let cut = p
        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    c_type(&p[..cut])
}

/// A C type (`const moat_array* const*`) in Rust's spelling.
fn c_type(t: &str) -> String {
    let spaced = t.replace('*', " * ");
    let tokens: Vec<&str> = spaced.split_whitespace().collect();
    let stars = tokens.iter().position(|t| *t == "*").unwrap_or(tokens.len());
    let base: Vec<&str> = tokens[..stars].iter().copied().filter(|t| *t != "const").collect();
    let mut pointee_const = tokens[..stars].contains(&"const");
    let mut ty = match base.as_slice() {
        ["int"] => "c_int",
        ["char"] => "c_char",
        ["void"] => "c_void",
        ["size_t"] | ["uintptr_t"] => "usize",
        ["int32_t"] => "i32",
        ["int64_t"] => "i64",
        ["uint64_t"] => "u64",
        ["uint32_t"] => "u32",
        ["uint8_t"] => "u8",
        ["float"] => "f32",
        ["double"] => "f64",
        [name] if name.starts_with("moat_") => name,
        other => panic!("moat_shim.h: no Rust mapping for C type {other:?} (in {t:?})"),
    }
    .to_string();
    let mut rest = tokens[stars..].iter().peekable();
    while let Some(token) = rest.next() {
        assert_eq!(*token, "*", "unexpected {token:?} in C type {t:?}");
        ty = format!("*{} {ty}", if pointee_const { "const" } else { "mut" });
        pointee_const = rest.next_if(|t| **t == "const").is_some();
    }
    ty
}

/// The declarations in ffi.rs's `extern "C"` block, by name.
fn rust_functions() -> BTreeMap<String, Signature> {
    let text: String = FFI
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let block = &text[text.find("extern \"C\" {").expect("an extern block")..];
    let mut out = BTreeMap::new();
    for decl in block.split("pub fn ").skip(1) {
        let decl = &decl[..decl.find(';').expect("a declaration ends with ;")];
        let open = decl.find('(').unwrap();
        let name = decl[..open].trim().to_string();
        let close = matching_paren(decl, open);
        let params = split_top_level(&decl[open + 1..close])
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(|p| normalise(p.split_once(':').expect("name: type").1))
            .collect();
        let ret = decl[close + 1..].trim();
        let ret = ret.strip_prefix("->").map_or("()".to_string(), normalise);
        out.insert(name, (params, ret));
    }
    out
}

fn normalise(t: &str) -> String {
    t.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("( ", "(")
        .replace(" )", ")")
}

fn matching_paren(s: &str, open: usize) -> usize {
    let mut depth = 0;
    for (i, c) in s.char_indices().skip(open) {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced parentheses in {s:?}")
}

/// Splits at commas outside parentheses, trimmed.
fn split_top_level(s: &str) -> Vec<String> {
    let (mut parts, mut depth, mut current) = (Vec::new(), 0, String::new());
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(current.trim().to_string());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    parts.push(current.trim().to_string());
    parts
}

fn strip_c_comments(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while !rest.is_empty() {
        if let Some(tail) = rest.strip_prefix("//") {
            rest = tail.find('\n').map_or("", |i| &tail[i..]);
        } else if let Some(tail) = rest.strip_prefix("/*") {
            rest = tail.find("*/").map_or("", |i| &tail[i + 2..]);
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}
