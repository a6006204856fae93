//! The layer rules of `LAYOUT.md`, checked on the source: every `engine/**/*.rs` file is read,
//! its `use` declarations (`use crate::…`, `use super::…`, `pub use`, grouped and multi-line
//! `use crate::{a::X, b::Y}`) and inline paths in code (`crate::units::format_bytes(x)`; comments,
//! doc comments and string literals are skipped) are resolved to the top-level module they name,
//! and the test fails naming the file, the line and the `use` when an import
//!
//! - points up a layer,
//! - breaks a per-module rule (`model/` never imports `runtime/`, `store/`, `cache/`,
//!   `dictionary` nor spawns threads; `store/` does not import `config/`; `cache/` imports only
//!   L0 (`ids`, `error`, `units`, `io`, `atomic`); `error.rs` imports only `ids` and `units`),
//! - reaches the binary (`engine/main.rs`, `engine/cli/`) from the library,
//! - or closes a cycle among the top-level modules ("units": a folder is one unit, `lib.rs` is
//!   not one), reported with one `use` line per edge of the cycle.
//!
//! It also checks that every top-level module has a layer here and that the crate map in
//! `engine/lib.rs` puts it in the same layer. Run alone with `.ci/layers`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The layers, lowest first. The binary (L6) is `engine/main.rs` and `engine/cli/**`.
const LAYERS: &[(usize, &[&str])] = &[
    (
        0,
        &[
            "error",
            "ids",
            "units",
            "io",
            "atomic",
            "interrupt",
            "memory",
        ],
    ),
    (
        1,
        &[
            "config",
            "weights",
            "quant",
            "store",
            "cache",
            "dictionary",
            "manifest",
        ],
    ),
    (2, &["model"]),
    (3, &["runtime", "bundle", "tokenizer"]),
    (4, &["generation"]),
    (5, &["offline", "bench", "serve"]),
];
const BINARY_LAYER: usize = 6;
/// The binary's own top-level modules (below `engine/main.rs`).
const BINARY_UNITS: &[&str] = &["cli", "main"];

/// Per-module rules beyond the layers: `(unit, imports it may never make, why)`.
const FORBIDDEN: &[(&str, &[&str], &str)] = &[
    (
        "model",
        &["runtime", "store", "cache", "dictionary"],
        "the model asks the provider for expert weights and reports its routing; nothing else",
    ),
    (
        "store",
        &["config"],
        "the store knows bytes, offsets, encodings and checksums, not `ModelSpec`",
    ),
];
/// Units that may import only the listed ones: `(unit, allowed, why)`.
const ONLY: &[(&str, &[&str], &str)] = &[
    (
        "cache",
        &["ids", "error", "units", "io", "atomic"],
        "the cache is pure bookkeeping over L0",
    ),
    ("error", &["ids", "units"], "error.rs imports only leaves"),
];
/// Units that must not spawn threads: `(unit, tokens that mean a thread)`.
const NO_THREADS: &[(&str, &[&str])] = &[("model", &["thread", "rayon", "crossbeam_channel"])];

/// Import edges known to close a cycle, pending a fix in `engine/`: `(from, to, why)`. Each is
/// kept out of the cycle search only; the test fails once the edge is gone, so the entry is
/// removed with the fix.
const KNOWN_CYCLE_EDGES: &[(&str, &str, &str)] = &[];

fn engine_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("engine")
}

/// A reference from one file to a module path, with where it is written.
#[derive(Clone, Debug)]
struct Reference {
    file: String,
    line: usize,
    /// The `use` declaration (collapsed to one line) or the inline path.
    text: String,
    /// The top-level unit the path reaches.
    target: String,
    /// Whether the target is in the library (`crate::` in a library file, `edgemoe::` anywhere).
    into_library: bool,
}

impl Reference {
    fn at(&self) -> String {
        format!("{}:{}: {}", self.file, self.line, self.text)
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Blanks comments, string and char literals (keeping line breaks) so that only code remains.
fn code_only(src: &str) -> Vec<char> {
    let s: Vec<char> = src.chars().collect();
    let mut out = s.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for c in out.iter_mut().take(to.min(s.len())).skip(from) {
            if *c != '\n' {
                *c = ' ';
            }
        }
    };
    let ident_char = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let next = s.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            let end = s[i..]
                .iter()
                .position(|&c| c == '\n')
                .map_or(s.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if c == '/' && next == Some('*') {
            let (mut depth, mut j) = (1, i + 2);
            while j < s.len() && depth > 0 {
                if s[j] == '/' && s.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if s[j] == '*' && s.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if (c == 'r' || (c == 'b' && next == Some('r')))
            && (i == 0 || !ident_char(s[i - 1]))
            && {
                // Raw string: r"…", r#"…"#, br#"…"#.
                let start = if c == 'b' { i + 2 } else { i + 1 };
                let hashes = s[start..].iter().take_while(|&&c| c == '#').count();
                s.get(start + hashes) == Some(&'"')
            }
        {
            let start = if c == 'b' { i + 2 } else { i + 1 };
            let hashes = s[start..].iter().take_while(|&&c| c == '#').count();
            let mut j = start + hashes + 1;
            loop {
                if j >= s.len() {
                    break;
                }
                if s[j] == '"'
                    && s[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&c| c == '#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            blank(&mut out, i, j);
            i = j;
        } else if c == '"' {
            let mut j = i + 1;
            while j < s.len() && s[j] != '"' {
                j += if s[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i, j + 1);
            i = j + 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): only the first is blanked.
            if next == Some('\\') {
                let mut j = i + 2;
                while j < s.len() && s[j] != '\'' {
                    j += 1;
                }
                blank(&mut out, i, j + 1);
                i = j + 1;
            } else if s.get(i + 2) == Some(&'\'') {
                blank(&mut out, i, i + 3);
                i += 3;
            } else {
                i += 1;
            }
        } else if ident_char(c) {
            // Skip whole identifiers so that a trailing `r`/`b` is not read as a raw string.
            while i < s.len() && ident_char(s[i]) {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Tokens of the code with their 1-based line numbers.
fn tokens(code: &[char]) -> Vec<(Tok, usize)> {
    let mut toks = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < code.len() {
        let c = code[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < code.len() && (code[i].is_alphanumeric() || code[i] == '_') {
                i += 1;
            }
            let mut word: String = code[start..i].iter().collect();
            // Raw identifiers: r#type.
            if word == "r" && code.get(i) == Some(&'#') {
                let start = i + 1;
                i = start;
                while i < code.len() && (code[i].is_alphanumeric() || code[i] == '_') {
                    i += 1;
                }
                word = code[start..i].iter().collect();
            }
            toks.push((Tok::Ident(word), line));
        } else if c == ':' && code.get(i + 1) == Some(&':') {
            toks.push((Tok::Path, line));
            i += 2;
        } else {
            toks.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    toks
}

/// One leaf of a `use` tree: its path segments and the line of its last segment.
type Leaf = (Vec<String>, usize);

/// Parses a use tree starting at `toks[*i]` with the segments above it in `prefix` (non-empty
/// inside a group).
fn use_tree(toks: &[(Tok, usize)], i: &mut usize, prefix: &[String], leaves: &mut Vec<Leaf>) {
    let mut path = prefix.to_vec();
    let mut line = toks.get(*i).map_or(0, |t| t.1);
    while let Some((tok, at)) = toks.get(*i) {
        match tok {
            // A leading `::` (a path from the extern prelude); otherwise a separator.
            Tok::Path if path.is_empty() => path.push("::".into()),
            Tok::Path => {}
            // `as name` renames the leaf; the path is already complete.
            Tok::Ident(word) if word == "as" => {
                *i += 2;
                break;
            }
            // `{self, …}` in a group: the group's prefix itself.
            Tok::Ident(word)
                if word == "self" && !prefix.is_empty() && path.len() == prefix.len() =>
            {
                line = *at
            }
            Tok::Ident(word) => {
                line = *at;
                path.push(word.clone());
            }
            Tok::Punct('*') => {
                line = *at;
                path.push("*".into());
            }
            Tok::Punct('{') => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => use_tree(toks, i, &path, leaves),
                    }
                }
            }
            _ => break,
        }
        *i += 1;
    }
    leaves.push((path, line));
}

/// Which crate a file belongs to.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Krate {
    Library,
    Binary,
}

struct SourceFile {
    /// Relative to the repository root, e.g. `engine/model/layers.rs`.
    name: String,
    krate: Krate,
    /// The module path of the file (`["model", "layers"]`; `[]` for `lib.rs` and `main.rs`).
    module: Vec<String>,
    text: String,
}

impl SourceFile {
    /// The top-level unit: the first module segment (`None` for the crate roots).
    fn unit(&self) -> Option<&str> {
        self.module.first().map(String::as_str)
    }
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rs_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn source_files() -> Vec<SourceFile> {
    let engine = engine_dir();
    let mut paths = Vec::new();
    rs_files(&engine, &mut paths);
    paths
        .into_iter()
        .map(|path| {
            let rel = path.strip_prefix(&engine).unwrap();
            let mut module: Vec<String> = rel
                .iter()
                .map(|s| s.to_str().unwrap().trim_end_matches(".rs").to_string())
                .collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            let krate = match module.first().map(String::as_str) {
                Some("main") | Some("cli") => Krate::Binary,
                _ => Krate::Library,
            };
            if module == ["lib"] || module == ["main"] {
                module.clear();
            }
            SourceFile {
                name: format!("engine/{}", rel.display()),
                krate,
                module,
                text: std::fs::read_to_string(&path).unwrap(),
            }
        })
        .collect()
}

/// Items re-exported at a crate root (`pub use error::{Error, Result};` in `lib.rs`): name → the
/// module they come from.
#[derive(Default)]
struct RootNames {
    library: BTreeMap<String, String>,
    binary: BTreeMap<String, String>,
}

fn root_names(files: &[SourceFile]) -> RootNames {
    let reexports = |name: &str| {
        let mut map = BTreeMap::new();
        let Some(root) = files.iter().find(|f| f.name == name) else {
            return map;
        };
        let toks = tokens(&code_only(&root.text));
        for i in 0..toks.len() {
            if toks[i].0 == Tok::Ident("use".into()) {
                let (mut j, mut leaves) = (i + 1, Vec::new());
                use_tree(&toks, &mut j, &[], &mut leaves);
                for (path, _) in leaves {
                    let path: Vec<&str> = path
                        .iter()
                        .map(String::as_str)
                        .skip_while(|s| *s == "crate" || *s == "self")
                        .collect();
                    if let (Some(module), Some(item)) = (path.first(), path.last()) {
                        if path.len() > 1 && *item != "*" {
                            map.insert(item.to_string(), module.to_string());
                        }
                    }
                }
            }
        }
        map
    };
    RootNames {
        library: reexports("engine/lib.rs"),
        binary: reexports("engine/main.rs"),
    }
}

/// Resolves a path written in `file` inside the inline module `inline` (e.g. `mod tests`) to the
/// unit it reaches: `Some((unit, into_library))`, or `None` for paths outside this package
/// (`std::…`, other crates, local names).
fn resolve(
    file: &SourceFile,
    inline: &[String],
    path: &[String],
    root: &RootNames,
) -> Option<(String, bool)> {
    let mut segs: Vec<&str> = path.iter().map(String::as_str).collect();
    if segs.first() == Some(&"::") {
        segs.remove(0);
        if segs.first() != Some(&"edgemoe") {
            return None;
        }
    }
    let mut module: Vec<String> = file.module.iter().chain(inline).cloned().collect();
    let (base, rest, into_library): (Vec<String>, &[&str], bool) = match segs.first().copied() {
        Some("crate") => (Vec::new(), &segs[1..], file.krate == Krate::Library),
        Some("edgemoe") => (Vec::new(), &segs[1..], true),
        Some("self") => (module, &segs[1..], file.krate == Krate::Library),
        Some("super") => {
            let mut k = 0;
            while segs.get(k) == Some(&"super") {
                if module.pop().is_none() {
                    panic!(
                        "{}: `{}` goes above the crate root",
                        file.name,
                        path.join("::")
                    );
                }
                k += 1;
            }
            (module, &segs[k..], file.krate == Krate::Library)
        }
        _ => return None,
    };
    let unit = match base.first() {
        Some(first) => first.clone(),
        // A name at the crate root: a module, or an item `lib.rs` re-exports (`crate::Error`).
        None => {
            let name = rest.first()?;
            let krate = if into_library {
                &root.library
            } else {
                &root.binary
            };
            krate.get(*name).cloned().unwrap_or(name.to_string())
        }
    };
    Some((unit, into_library))
}

/// Every reference to a module of this package in one file.
fn references(file: &SourceFile, root: &RootNames) -> Vec<Reference> {
    let code = code_only(&file.text);
    let toks = tokens(&code);
    let lines: Vec<&str> = file.text.lines().collect();
    let mut refs = Vec::new();
    // Inline modules (`mod tests { … }`) with the brace depth they close at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let mut push = |inline: &[(String, usize)], path: &[String], line: usize, text: String| {
        let names: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
        if let Some((target, into_library)) = resolve(file, &names, path, root) {
            refs.push(Reference {
                file: file.name.clone(),
                line,
                text,
                target,
                into_library,
            });
        }
    };
    while i < toks.len() {
        let ident = |k: usize| match toks.get(k) {
            Some((Tok::Ident(w), _)) => Some(w.as_str()),
            _ => None,
        };
        match &toks[i].0 {
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(w)
                if w == "mod" && toks.get(i + 2).map(|t| &t.0) == Some(&Tok::Punct('{')) =>
            {
                let name = ident(i + 1).unwrap_or_default().to_string();
                inline.push((name, depth + 1));
                i += 2;
            }
            Tok::Ident(w)
                if w == "use" && toks.get(i.wrapping_sub(1)).map(|t| &t.0) != Some(&Tok::Path) =>
            {
                let start_line = toks[i].1;
                let mut j = i + 1;
                let mut leaves = Vec::new();
                use_tree(&toks, &mut j, &[], &mut leaves);
                while j < toks.len() && toks[j].0 != Tok::Punct(';') {
                    j += 1;
                }
                let end_line = toks.get(j).map_or(start_line, |t| t.1);
                let text = lines[start_line - 1..end_line.min(lines.len())]
                    .iter()
                    .map(|l| l.trim())
                    .collect::<Vec<_>>()
                    .join(" ")
                    .replace("{ ", "{")
                    .replace(", }", "}")
                    .replace(" }", "}");
                for (path, line) in leaves {
                    push(&inline, &path, line, text.clone());
                }
                i = j + 1;
            }
            Tok::Ident(w)
                if matches!(w.as_str(), "crate" | "super" | "self" | "edgemoe")
                    && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path)
                    && toks.get(i.wrapping_sub(1)).map(|t| &t.0) != Some(&Tok::Path)
                    && toks.get(i.wrapping_sub(1)).map(|t| &t.0) != Some(&Tok::Punct('.')) =>
            {
                // An inline path: `crate::units::format_bytes(x)`.
                let line = toks[i].1;
                let mut path = vec![w.clone()];
                let mut j = i + 1;
                while toks.get(j).map(|t| &t.0) == Some(&Tok::Path) {
                    match ident(j + 1) {
                        Some(seg) => path.push(seg.to_string()),
                        None => break,
                    }
                    j += 2;
                }
                let text = format!(
                    "{} (inline path `{}`)",
                    lines[line - 1].trim(),
                    path.join("::")
                );
                push(&inline, &path, line, text);
                i = j;
            }
            _ => i += 1,
        }
    }
    refs
}

/// Lines of `file` (code only) that mention one of `words` as an identifier.
fn mentions(file: &SourceFile, words: &[&str]) -> Vec<(usize, String)> {
    let code = code_only(&file.text);
    let lines: Vec<&str> = file.text.lines().collect();
    let mut found: Vec<(usize, String)> = tokens(&code)
        .into_iter()
        .filter_map(|(t, line)| match t {
            Tok::Ident(w) if words.contains(&w.as_str()) => Some(line),
            _ => None,
        })
        .map(|line| (line, lines[line - 1].trim().to_string()))
        .collect();
    found.dedup();
    found
}

fn layer_of(unit: &str) -> Option<usize> {
    LAYERS
        .iter()
        .find(|(_, units)| units.contains(&unit))
        .map(|(l, _)| *l)
}

/// The layer the crate map in `lib.rs` gives each module it names: bullets `- Ln, …` list their
/// modules as links, [`name`].
fn crate_map(lib: &str) -> BTreeMap<String, usize> {
    let mut map = BTreeMap::new();
    let mut layer = None;
    for line in lib.lines().take_while(|l| l.starts_with("//!")) {
        let text = line.trim_start_matches("//!").trim();
        if let Some(rest) = text.strip_prefix("- L") {
            layer = rest
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse::<usize>()
                .ok();
        } else if !line.starts_with("//!   ") {
            layer = None;
        }
        let Some(l) = layer else { continue };
        for link in text.split("[`").skip(1) {
            if let Some(name) = link.split("`]").next() {
                let unit = name.split("::").next().unwrap();
                map.entry(unit.to_string()).or_insert(l);
            }
        }
    }
    map
}

/// Strongly connected components of more than one unit (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// A shortest cycle through `start` inside `component`, as its units (first = last).
fn cycle_through(
    graph: &BTreeMap<String, BTreeSet<String>>,
    component: &[String],
    start: &str,
) -> Vec<String> {
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if w == start {
                let mut path = vec![start.to_string(), v.to_string()];
                let mut at = v;
                while at != start {
                    at = parent[at];
                    path.push(at.to_string());
                }
                path.reverse();
                return path;
            }
            if component.iter().any(|c| c == w) && !parent.contains_key(w) {
                parent.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    unreachable!("{start} lies on a cycle of its component")
}

#[test]
fn imports_point_down_the_layers_without_cycles() {
    let files = source_files();
    assert!(
        files.iter().any(|f| f.name == "engine/lib.rs"),
        "engine/lib.rs not found under {}",
        engine_dir().display()
    );
    let mut problems: Vec<String> = Vec::new();
    let root = root_names(&files);

    // Every top-level module of the library has a layer, and the crate map agrees.
    let lib = files.iter().find(|f| f.name == "engine/lib.rs").unwrap();
    let map = crate_map(&lib.text);
    let mut units: BTreeSet<String> = BTreeSet::new();
    for f in files.iter().filter(|f| f.krate == Krate::Library) {
        if let Some(unit) = f.unit() {
            units.insert(unit.to_string());
        }
    }
    for unit in &units {
        match layer_of(unit) {
            None => problems.push(format!(
                "engine/{unit}: the module `{unit}` has no layer; add it to LAYERS in \
                 tests/layers.rs (and to the crate map in engine/lib.rs)"
            )),
            Some(l) => match map.get(unit) {
                Some(&m) if m == l => {}
                Some(&m) => problems.push(format!(
                    "engine/lib.rs: the crate map puts `{unit}` in L{m}, the layers put it in L{l}"
                )),
                None => problems.push(format!(
                    "engine/lib.rs: the crate map does not name `{unit}` (L{l})"
                )),
            },
        }
    }
    for (line, text) in mentions(lib, &["mod"]) {
        for unit in BINARY_UNITS {
            if text.contains(&format!("mod {unit};")) || text.contains(&format!("mod {unit} ")) {
                problems.push(format!(
                    "engine/lib.rs:{line}: {text}\n    the library declares the binary's module `{unit}`"
                ));
            }
        }
    }

    // Every reference, checked against the layers and the per-module rules.
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut witness: BTreeMap<(String, String), Reference> = BTreeMap::new();
    let mut checked = 0usize;
    let mut binary_imports = 0usize;
    for f in &files {
        for r in references(f, &root) {
            let to = r.target.as_str();
            match f.krate {
                Krate::Binary => {
                    if r.into_library {
                        binary_imports += 1;
                        if layer_of(to).is_none() && !units.contains(to) {
                            problems.push(format!(
                                "{}\n    `edgemoe::{to}` is not a module of the library",
                                r.at()
                            ));
                        }
                    }
                    continue;
                }
                Krate::Library => {}
            }
            if BINARY_UNITS.contains(&to) {
                problems.push(format!(
                    "{}\n    the library imports the binary (`{to}`)",
                    r.at()
                ));
                continue;
            }
            let Some(from) = f.unit() else { continue }; // lib.rs
            if from == to {
                continue;
            }
            checked += 1;
            let (Some(lf), Some(lt)) = (layer_of(from), layer_of(to)) else {
                if !units.contains(to) {
                    problems.push(format!(
                        "{}\n    `{to}` is not a top-level module of the library",
                        r.at()
                    ));
                }
                continue;
            };
            if lt > lf {
                problems.push(format!(
                    "{}\n    upward import: `{from}` (L{lf}) imports `{to}` (L{lt})",
                    r.at()
                ));
            }
            for (unit, never, why) in FORBIDDEN {
                if from == *unit && never.contains(&to) {
                    problems.push(format!(
                        "{}\n    `{from}` never imports `{to}`: {why}",
                        r.at()
                    ));
                }
            }
            for (unit, only, why) in ONLY {
                if from == *unit && !only.contains(&to) {
                    problems.push(format!(
                        "{}\n    `{from}` imports only {}: {why}",
                        r.at(),
                        only.join(", ")
                    ));
                }
            }
            graph
                .entry(from.to_string())
                .or_default()
                .insert(to.to_string());
            witness
                .entry((from.to_string(), to.to_string()))
                .or_insert(r);
        }
        for (unit, words) in NO_THREADS {
            if f.unit() == Some(unit) {
                for (line, text) in mentions(f, words) {
                    problems.push(format!(
                        "{}:{line}: {text}\n    `{unit}` does not spawn threads",
                        f.name
                    ));
                }
            }
        }
    }

    // Cycles among the units, one `use` line per edge; known edges are set aside.
    let mut known = Vec::new();
    for (from, to, why) in KNOWN_CYCLE_EDGES {
        let key = (from.to_string(), to.to_string());
        match witness.get(&key) {
            Some(r) => {
                graph.get_mut(*from).unwrap().remove(*to);
                known.push(format!("{from} → {to} ({}:{}): {why}", r.file, r.line));
            }
            None => problems.push(format!(
                "tests/layers.rs: the known cycle edge {from} → {to} is gone; remove it from \
                 KNOWN_CYCLE_EDGES"
            )),
        }
    }
    for component in cycles(&graph) {
        let cycle = cycle_through(&graph, &component, &component[0]);
        let mut text = format!("cycle among {}:", cycle.join(" → "));
        for pair in cycle.windows(2) {
            let r = &witness[&(pair[0].clone(), pair[1].clone())];
            let _ = write!(text, "\n    {} → {}: {}", pair[0], pair[1], r.at());
        }
        problems.push(text);
    }

    if !problems.is_empty() {
        panic!(
            "{} layer problem(s) (LAYOUT.md):\n{}",
            problems.len(),
            problems.join("\n")
        );
    }

    // The summary, top layer first.
    let binary = files.iter().filter(|f| f.krate == Krate::Binary).count();
    let mut summary = format!(
        "  L{BINARY_LAYER}  the binary: {binary} file(s), {binary_imports} paths into the library\n"
    );
    for (layer, names) in LAYERS.iter().rev() {
        let present: Vec<&str> = names
            .iter()
            .copied()
            .filter(|u| units.contains(*u))
            .collect();
        let count = files
            .iter()
            .filter(|f| f.krate == Krate::Library && f.unit().is_some_and(|u| present.contains(&u)))
            .count();
        let _ = writeln!(
            summary,
            "  L{layer}  {} module(s), {count:>2} file(s): {}",
            present.len(),
            present.join(" ")
        );
    }
    let edges: usize = graph.values().map(BTreeSet::len).sum::<usize>() + known.len();
    println!(
        "layers: {} files, {} library modules, {checked} cross-module references ({edges} module \
         edges)\n{summary}no upward import, no cycle{}",
        files.len(),
        units.len(),
        if known.is_empty() {
            String::new()
        } else {
            format!(" (apart from {} known edge(s) below)", known.len())
        }
    );
    for k in &known {
        println!("known cycle edge, pending a fix in engine/: {k}");
    }
}

#[test]
fn the_parser_reads_every_form_of_import() {
    let file = SourceFile {
        name: "engine/runtime/buffer.rs".into(),
        krate: Krate::Library,
        module: vec!["runtime".into(), "buffer".into()],
        text: r##"//! Docs mention crate::offline::tune and `use crate::bench::x;`.
use std::sync::Arc;
use crate::{
    cache::{Policy, SlotTable},
    ids::ExpertId,
};
pub use crate::store::ExpertStore as Store;
use super::stats::{self, ExpertStats};
use super::super::model::provider::ExpertProvider;
use edgemoe::units::format_bytes;
/* use crate::generation::session; */
fn f() {
    let s = "crate::serve::nothing";
    let c = '"';
    let _ = crate::units::format_bytes(1);
    let x: &'static str = r#"crate::bench"#;
    self::g();
}
mod tests {
    use super::*;
    use super::super::predict::Predictor;
}
"##
        .into(),
    };
    let found: Vec<(usize, String)> = references(&file, &RootNames::default())
        .into_iter()
        .map(|r| (r.line, r.target))
        .collect();
    let mut found = found;
    found.dedup();
    let want: Vec<(usize, String)> = [
        (4, "cache"),
        (5, "ids"),
        (7, "store"),
        (8, "runtime"),
        (9, "model"),
        (10, "units"),
        (15, "units"),
        (17, "runtime"),
        (20, "runtime"),
        (21, "runtime"),
    ]
    .into_iter()
    .map(|(l, u)| (l, u.to_string()))
    .collect();
    assert_eq!(found, want);
}
