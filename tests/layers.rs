//! The shape of `src/`, checked: no import cycle between its files, each folder imports only
//! the folders before it in the data flow (the order in `src/lib.rs`), and no file grows past
//! a size a reader can hold. No server needed: it reads the source.
//!
//! How references are found: every `crate::a::b`, `super::a`, `self::a` path, and paths that
//! start with the name of a child module, in `use` lines and in code. Each resolves to the
//! deepest module file it names (`crate::sink::kafka::encode` -> `src/sink/kafka/mod.rs`).
//! `mod x;` declarations are not references.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level folders of `src/` and what each may import (besides itself). The order is the
/// data flow's: each may use those before it, never one after it.
const LAYERS: &[(&str, &[&str])] = &[
    ("model", &[]),
    ("observe", &["model"]),
    ("source", &["model", "observe"]),
    ("sink", &["model", "observe"]),
    ("state", &["model", "observe", "sink"]),
    ("coordination", &["model", "observe", "sink", "state"]),
    ("delivery", &["model", "observe", "sink", "state"]),
    ("shaping", &["model", "observe", "source", "sink", "delivery"]),
    ("config", &["model", "observe", "source", "sink", "state", "coordination", "delivery", "shaping"]),
    ("app", &["model", "observe", "source", "sink", "state", "coordination", "delivery", "shaping", "config"]),
];

/// Lines a file in `src/` may have.
const MAX_LINES: usize = 650;

type Module = Vec<String>;

struct Source {
    /// Module path -> file.
    files: BTreeMap<Module, PathBuf>,
}

impl Source {
    fn read(src: &Path) -> Source {
        let mut files = BTreeMap::new();
        let mut stack = vec![src.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let rel = path.strip_prefix(src).unwrap();
                    let mut module: Module =
                        rel.with_extension("").iter().map(|s| s.to_string_lossy().into_owned()).collect();
                    if module.last().is_some_and(|l| l == "mod" || l == "lib") {
                        module.pop();
                    }
                    if module == ["main"] {
                        continue; // the binary: a crate of its own
                    }
                    files.insert(module, path);
                }
            }
        }
        Source { files }
    }

    /// The deepest module named by `path` (absolute segments), if it is one of ours.
    fn resolve(&self, path: &[String]) -> Option<Module> {
        (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|m| self.files.contains_key(m))
    }

    /// The modules `module`'s file refers to.
    fn references(&self, module: &Module) -> BTreeSet<Module> {
        let text = std::fs::read_to_string(&self.files[module]).unwrap();
        let children: BTreeSet<&str> = self
            .files
            .keys()
            .filter(|m| m.len() == module.len() + 1 && m.starts_with(module))
            .map(|m| m.last().unwrap().as_str())
            .collect();
        let mut out = BTreeSet::new();
        // Inline modules (`mod tests { ... }`) open at these brace depths: `super` inside one
        // is the file's own module.
        let mut inline: Vec<(usize, String)> = Vec::new();
        let mut depth = 0usize;
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            let code = code.trim_start();
            let opens = code.matches('{').count();
            let closes = code.matches('}').count();
            if let Some(rest) = code.strip_prefix("mod ").or_else(|| code.strip_prefix("pub mod "))
                && let Some(name) = rest.strip_suffix('{')
            {
                inline.push((depth, name.trim().to_string()));
            }
            depth = (depth + opens).saturating_sub(closes);
            while inline.last().is_some_and(|(at, _)| depth <= *at && closes > 0) {
                inline.pop();
            }
            if code.starts_with("mod ") || code.starts_with("pub mod ") || code.starts_with("pub(crate) mod ") {
                continue;
            }
            for path in paths_in(code) {
                let absolute: Option<Vec<String>> = match path[0].as_str() {
                    "crate" => Some(path[1..].to_vec()),
                    "super" => {
                        let mut base: Module =
                            module.iter().cloned().chain(inline.iter().map(|(_, n)| n.clone())).collect();
                        let mut rest = &path[..];
                        while rest.first().is_some_and(|s| s == "super") {
                            base.pop();
                            rest = &rest[1..];
                        }
                        Some(base.into_iter().chain(rest.iter().cloned()).collect())
                    }
                    "self" => Some(module.iter().chain(path[1..].iter()).cloned().collect()),
                    first if children.contains(first) => Some(module.iter().chain(path.iter()).cloned().collect()),
                    _ => None,
                };
                if let Some(target) = absolute.and_then(|a| self.resolve(&a))
                    && &target != module
                {
                    out.insert(target);
                }
            }
        }
        out
    }
}

/// `a::b::{c, d::e}` style paths in one line of code, braces expanded one level.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !is_ident(bytes[i]) || (i > 0 && (is_ident(bytes[i - 1]) || bytes[i - 1] == b':')) {
            i += 1;
            continue;
        }
        // An identifier starts at i: read `ident(::ident)*`, then a `::{...}` group.
        let mut segs = Vec::new();
        let mut j = i;
        loop {
            let start = j;
            while j < bytes.len() && is_ident(bytes[j]) {
                j += 1;
            }
            segs.push(code[start..j].to_string());
            if code[j..].starts_with("::") && j + 2 < bytes.len() && is_ident(bytes[j + 2]) {
                j += 2;
            } else {
                break;
            }
        }
        if code[j..].starts_with("::{") {
            let close = code[j..].find('}').map_or(code.len(), |c| j + c);
            for part in code[j + 3..close].split(',') {
                let part = part.trim();
                let name: Vec<String> = part
                    .split("::")
                    .map(|s| s.trim().trim_start_matches('{').to_string())
                    .filter(|s| !s.is_empty())
                    .collect();
                if !name.is_empty() && name[0].bytes().all(is_ident) {
                    out.push(segs.iter().cloned().chain(name).collect());
                }
            }
            j = close;
        }
        if segs.len() > 1 || out.last().is_some_and(|l: &Vec<String>| l.starts_with(&segs)) {
            out.push(segs);
        }
        i = j.max(i + 1);
    }
    out
}

fn source() -> Source {
    Source::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn no_import_cycle_between_files() {
    let src = source();
    let graph: BTreeMap<Module, BTreeSet<Module>> = src.files.keys().map(|m| (m.clone(), src.references(m))).collect();
    // Depth-first search; a back edge is a cycle.
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    let mut mark: BTreeMap<&Module, Mark> = graph.keys().map(|m| (m, Mark::New)).collect();
    let mut cycles = Vec::new();
    fn visit<'a>(
        m: &'a Module,
        graph: &'a BTreeMap<Module, BTreeSet<Module>>,
        mark: &mut BTreeMap<&'a Module, Mark>,
        stack: &mut Vec<&'a Module>,
        cycles: &mut Vec<String>,
    ) {
        mark.insert(m, Mark::Open);
        stack.push(m);
        for next in &graph[m] {
            match mark[next] {
                Mark::New => visit(next, graph, mark, stack, cycles),
                Mark::Open => {
                    let at = stack.iter().position(|s| *s == next).unwrap();
                    let names: Vec<String> = stack[at..].iter().chain([&next]).map(|m| m.join("::")).collect();
                    cycles.push(names.join(" -> "));
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        mark.insert(m, Mark::Done);
    }
    for m in graph.keys() {
        if mark[m] == Mark::New {
            visit(m, &graph, &mut mark, &mut Vec::new(), &mut cycles);
        }
    }
    assert!(cycles.is_empty(), "import cycles in src/:\n{}", cycles.join("\n"));
    // The check finds references at all (a parser that finds none would pass vacuously).
    assert!(
        graph[&vec!["app".to_string(), "run".to_string()]].len() > 5,
        "{:?}",
        graph[&vec!["app".to_string(), "run".to_string()]]
    );
}

#[test]
fn folders_import_only_earlier_stages() {
    let src = source();
    let allowed: BTreeMap<&str, &[&str]> = LAYERS.iter().copied().collect();
    let mut wrong = Vec::new();
    let mut folders = BTreeSet::new();
    for m in src.files.keys() {
        let Some(folder) = m.first() else { continue }; // lib.rs
        folders.insert(folder.as_str());
        let may = allowed.get(folder.as_str()).unwrap_or_else(|| {
            panic!("src/{folder} is not in LAYERS of tests/layers.rs: add it where it belongs in the data flow")
        });
        for target in src.references(m) {
            let to = target[0].as_str();
            if to != folder && !may.contains(&to) {
                wrong.push(format!(
                    "{} imports {} ({to} comes later in the data flow)",
                    m.join("::"),
                    target.join("::")
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(folders.len(), LAYERS.len(), "every layer exists: {folders:?}");
}

#[test]
fn no_file_is_too_long() {
    let src = source();
    let long: Vec<String> = src
        .files
        .values()
        .filter_map(|p| {
            let n = std::fs::read_to_string(p).unwrap().lines().count();
            (n > MAX_LINES).then(|| format!("{} has {n} lines", p.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these (at most {MAX_LINES} lines):\n{}", long.join("\n"));
}

#[test]
fn the_path_reader_finds_what_it_should() {
    let p = paths_in("use crate::sink::{Outbound, kafka::encode}; let x = super::super::a::b(c::d);");
    assert!(p.contains(&vec!["crate".into(), "sink".into(), "Outbound".into()]), "{p:?}");
    assert!(p.contains(&vec!["crate".into(), "sink".into(), "kafka".into(), "encode".into()]), "{p:?}");
    assert!(p.contains(&vec!["super".into(), "super".into(), "a".into(), "b".into()]), "{p:?}");
    assert!(p.contains(&vec!["c".into(), "d".into()]), "{p:?}");
}
