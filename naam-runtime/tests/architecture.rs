//! Structure the code must keep (docs/ARCHITECTURE.md): no import cycle between naam-runtime's
//! modules, and no IO, thread, clock or OS randomness in naam-proto. Read from the source text, so a change
//! that breaks either fails here with the modules that did it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("readable source directory") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The code of a file without comments and without its unit tests.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("readable source file");
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `udp/client.rs` → `udp::client`; `udp/mod.rs` → `udp`.
fn module_name(src: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(src).expect("under src");
    let s = rel.with_extension("").to_string_lossy().replace('/', "::");
    s.strip_suffix("::mod").map(str::to_string).unwrap_or(s)
}

/// The paths a `use` group names: `{a::B, c::{D, E}, f}` gives `a::B`, `c::`, `f` (the
/// leading path of each element is enough to find the module it comes from).
fn group_paths(rest: &str) -> Vec<String> {
    let mut depth = 0usize;
    let mut element = String::new();
    let mut out = Vec::new();
    for c in rest.chars() {
        match c {
            '{' => {
                depth += 1;
                if depth > 1 {
                    element.push(c);
                }
            }
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    out.push(std::mem::take(&mut element));
                    break;
                }
                element.push(c);
            }
            ',' if depth == 1 => out.push(std::mem::take(&mut element)),
            _ if depth >= 1 => element.push(c),
            _ => break,
        }
    }
    out.into_iter()
        .map(|e| {
            e.trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect::<String>()
        })
        .filter(|e| !e.is_empty())
        .collect()
}

/// Items the crate root re-exports from a module (`pub use clock::{Clock, VirtualClock};` in
/// lib.rs maps `Clock` and `VirtualClock` to `clock`), so that `crate::Clock` counts as a use
/// of `clock`.
fn root_re_exports(lib: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let statements = lib.split(';');
    for st in statements {
        let st = st.trim();
        let Some(rest) = st
            .strip_prefix("pub use ")
            .or_else(|| st.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let Some((module, items)) = rest.split_once("::") else {
            continue;
        };
        if !modules.contains(module) {
            continue;
        }
        let names: Vec<String> = if items.starts_with('{') {
            group_paths(items)
        } else {
            vec![items.to_string()]
        };
        for n in names {
            let last = n.rsplit("::").next().unwrap_or(&n).to_string();
            out.insert(last, module.to_string());
        }
    }
    out
}

/// Modules named after `prefix` in `code` (`crate::a::b` gives `a::b` when `a::b` is a module,
/// else `a`; `crate::{a::X, b}` gives `a` and `b`; `crate::Item` gives the module the crate root
/// re-exports `Item` from).
fn references(
    code: &str,
    prefix: &str,
    parent: &str,
    modules: &BTreeSet<String>,
    root_items: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices(prefix) {
        let rest = &code[i + prefix.len()..];
        let paths = if rest.starts_with('{') {
            group_paths(rest)
        } else {
            vec![rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect()]
        };
        let base = if parent.is_empty() {
            String::new()
        } else {
            format!("{parent}::")
        };
        for path in paths {
            let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
            let mut best = None;
            for n in 1..=parts.len() {
                let candidate = format!("{base}{}", parts[..n].join("::"));
                if modules.contains(&candidate) {
                    best = Some(candidate);
                }
            }
            if best.is_none() && parent.is_empty() {
                best = parts.first().and_then(|p| root_items.get(*p)).cloned();
            }
            out.extend(best);
        }
    }
    out
}

#[test]
fn naam_runtime_has_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files: Vec<PathBuf> = rust_files(&src)
        .into_iter()
        .filter(|p| !p.starts_with(src.join("bin")))
        .collect();
    let modules: BTreeSet<String> = files.iter().map(|p| module_name(&src, p)).collect();
    let root_items = root_re_exports(&code_of(&src.join("lib.rs")), &modules);
    assert!(
        root_items.get("Clock").map(String::as_str) == Some("clock"),
        "the crate root's re-exports are read: {root_items:?}"
    );
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in &files {
        let name = module_name(&src, path);
        let code = code_of(path);
        let parent = name.rsplit_once("::").map(|(p, _)| p).unwrap_or("");
        let mut deps: BTreeSet<String> = references(&code, "crate::", "", &modules, &root_items)
            .into_iter()
            .collect();
        deps.extend(references(&code, "super::", parent, &modules, &root_items));
        // A module may use its parent's items (`udp::MODE`) and its own children.
        deps.retain(|d| d != &name && !name.starts_with(&format!("{d}::")));
        deps.retain(|d| !d.starts_with(&format!("{name}::")));
        graph.insert(name, deps);
    }
    // Depth-first search for a back edge; report the cycle it closes.
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|s| s == m) {
            let mut cycle = stack[i..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        stack.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, graph, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        if let Some(cycle) = visit(m, &graph, &mut Vec::new(), &mut done) {
            panic!("import cycle: {}", cycle.join(" → "));
        }
    }
}

#[test]
fn naam_proto_does_no_io_and_reads_no_clock() {
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("proto");
    let forbidden = [
        "UdpSocket",
        "TcpStream",
        "TcpListener",
        "std::thread",
        "std::fs",
        "std::time::Instant",
        "SystemTime",
        "Instant::now",
        "std::env",
        "tokio",
        "libc",
        // Randomness is injected (naam_proto::entropy), so that a simulation replays bit for bit.
        "getrandom",
        "SystemRandom",
        "ring::rand",
        "OsRng",
        "thread_rng",
    ];
    for path in rust_files(&proto.join("src")) {
        let code = code_of(&path);
        for f in forbidden {
            assert!(
                !code.contains(f),
                "{} uses {f}: naam-proto is IO-free and takes time and randomness as arguments",
                path.display()
            );
        }
    }
    let manifest = std::fs::read_to_string(proto.join("Cargo.toml")).expect("manifest");
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .unwrap_or("")
        .split("\n[")
        .next()
        .unwrap_or("");
    for crate_name in [
        "tokio",
        "libc",
        "clap",
        "anyhow",
        "crossbeam",
        "getrandom",
        "rand",
    ] {
        assert!(
            !deps.contains(crate_name),
            "naam-proto depends on {crate_name}"
        );
    }
}

/// Each public item has one path: naam-runtime re-exports its sibling crates whole
/// (`naam_runtime::proto`, `naam_runtime::vm`), never a sibling crate's items one by one under
/// a second name, and naam-proto and naam-vm re-export nothing of their siblings.
#[test]
fn no_module_re_exports_another_crates_items() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let whole = ["pub use naam_proto as proto;", "pub use naam_vm as vm;"];
    for src in [
        root.join("src"),
        root.join("proto/src"),
        root.join("vm/src"),
    ] {
        for path in rust_files(&src) {
            let code = code_of(&path);
            for line in code.lines().map(str::trim) {
                let Some(rest) = line.strip_prefix("pub use ") else {
                    continue;
                };
                let sibling = rest.starts_with("naam_");
                assert!(
                    !sibling || whole.contains(&line),
                    "{}: `{line}` gives another crate's item a second public path",
                    path.display()
                );
            }
        }
    }
}

/// Each public item has one path inside its crate too: a `pub use` of an item from a module
/// that is itself public (`pub use crate::limits::MAX_MESSAGE;` in `frame`) names the item
/// twice. Re-exports from private modules (`mod clock;` with `pub use clock::Clock;` at the
/// root) are how a private module's items get their one path.
#[test]
fn no_item_has_a_second_path_inside_its_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for src in [
        root.join("src"),
        root.join("proto/src"),
        root.join("vm/src"),
    ] {
        let lib = code_of(&src.join("lib.rs"));
        let public: BTreeSet<String> = lib
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub mod "))
            .map(|m| m.trim_end_matches(';').to_string())
            .collect();
        assert!(
            !public.is_empty(),
            "{}: public modules are read",
            src.display()
        );
        for path in rust_files(&src) {
            let is_root = path == src.join("lib.rs");
            let code = code_of(&path);
            for line in code.lines().map(str::trim) {
                let Some(rest) = line.strip_prefix("pub use ") else {
                    continue;
                };
                let rest = rest
                    .strip_prefix("crate::")
                    .unwrap_or(if is_root { rest } else { "" });
                let module = rest.split("::").next().unwrap_or("");
                assert!(
                    !public.contains(module),
                    "{}: `{line}` gives an item of the public module `{module}` a second path",
                    path.display()
                );
            }
        }
    }
}
