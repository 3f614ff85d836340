//! No import cycles between the worker's modules, and the MLX layer knows
//! nothing of the wire. A module is a top-level one of port/src (its
//! submodules belong to it); an edge is a `crate::other` path in its code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap().to_str().unwrap().to_string();
            let module = rel.split('/').next().unwrap().trim_end_matches(".rs").to_string();
            if module == "main" || module == "lib" || !rel.ends_with(".rs") {
                continue;
            }
            let deps = graph.entry(module.clone()).or_default();
            let text = std::fs::read_to_string(&path).unwrap();
            for line in text.lines() {
                let code = line.split("//").next().unwrap();
                for (i, _) in code.match_indices("crate::") {
                    let name: String = code[i + 7..]
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if name != module {
                        deps.insert(name);
                    }
                }
            }
        }
    }
    graph
}

/// A cycle through `node`, if there is one, found depth first.
fn cycle(
    graph: &BTreeMap<String, BTreeSet<String>>,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    let node = path.last().unwrap().clone();
    for next in graph.get(&node).into_iter().flatten() {
        if let Some(i) = path.iter().position(|n| n == next) {
            let mut found = path[i..].to_vec();
            found.push(next.clone());
            return Some(found);
        }
        if done.contains(next) {
            continue;
        }
        path.push(next.clone());
        if let Some(found) = cycle(graph, path, done) {
            return Some(found);
        }
        path.pop();
    }
    done.insert(node);
    None
}

#[test]
fn the_modules_of_port_src_import_no_cycle() {
    let graph = edges();
    assert!(graph.len() > 10, "found modules {:?}", graph.keys());
    let mut done = BTreeSet::new();
    for module in graph.keys() {
        if let Some(found) = cycle(&graph, &mut vec![module.clone()], &mut done) {
            panic!("import cycle: {}", found.join(" -> "));
        }
    }
}

#[test]
fn the_mlx_layer_depends_on_nothing_above_it() {
    let graph = edges();
    let deps: Vec<&String> = graph["mlx"].iter().filter(|d| *d != "sys").collect();
    assert!(deps.is_empty(), "crate::mlx uses {deps:?}");
}
