//! The docs a newcomer reads stay true to the tree (issue 26 item 9): the module map in
//! docs/ARCHITECTURE.md names every file under `src/` and nothing that is gone, every relative
//! link and anchor in README.md and docs/ resolves, and the front pages stay short.
//!
//! Real files only, no server. The module map is the first fenced block after the
//! "## Module map" heading; its format is strict so that a slip fails here instead of being
//! skipped:
//! - an entry line starts with fewer than 24 spaces; its names are what comes before the first
//!   run of two spaces (one or several, separated by a space or ", "); the rest is its
//!   description. A line indented 24 spaces or more continues the description above it;
//! - a name is a path relative to the nearest directory entry (a name ending in `/`) indented
//!   less than it, or to the repository at indent 0 (`codec/tests.rs` names `codec/` too);
//!   `*` in a name matches any run of characters in one file name (`hub_*.rs`) and must match
//!   at least one file.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Column of the description; entries start left of it, continuation lines at it.
const DESCRIPTION_COLUMN: usize = 24;
const README_MAX_LINES: usize = 250;
const BENCHMARKS_MAX_LINES: usize = 300;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("cannot read {rel}: {e}"))
}

/// The lines of the first fenced block after `## Module map`, with their line numbers.
fn module_map_lines(architecture: &str) -> Vec<(usize, &str)> {
    let mut lines = architecture.lines().enumerate().map(|(i, l)| (i + 1, l));
    lines
        .by_ref()
        .find(|(_, l)| l.trim_end() == "## Module map")
        .expect("docs/ARCHITECTURE.md has no '## Module map' heading");
    lines
        .by_ref()
        .find(|(_, l)| l.starts_with("```"))
        .expect("no fenced block after '## Module map' in docs/ARCHITECTURE.md");
    let block: Vec<_> = lines.by_ref().take_while(|(_, l)| !l.starts_with("```")).collect();
    assert!(!block.is_empty(), "the module map in docs/ARCHITECTURE.md is empty");
    block
}

fn looks_like_path(name: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "_.*/-".contains(c);
    if name.is_empty() || !name.chars().all(allowed) {
        return false;
    }
    if name.ends_with('/') {
        return true;
    }
    let file = name.rsplit('/').next().unwrap();
    match file.rsplit_once('.') {
        Some((stem, ext)) => {
            !stem.is_empty()
                && (1..=5).contains(&ext.len())
                && ext.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        }
        None => false,
    }
}

/// `*` matches any run of characters (no `/`).
fn glob_match(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            name.starts_with(head)
                && (head.len()..=name.len())
                    .any(|i| glob_match(tail, &name[i..]) && !name[head.len()..i].contains('/'))
        }
    }
}

/// Every path the map names (files as `a/b.rs`, directories as `a/b/`), relative to the
/// repository; panics naming the line when a name is malformed or names nothing.
fn named_paths(map: &[(usize, &str)]) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    let mut problems = Vec::new();
    // Open directory entries: (indent, path ending in '/').
    let mut dirs: Vec<(usize, String)> = Vec::new();
    for &(number, line) in map {
        if line.trim().is_empty() {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        if indent >= DESCRIPTION_COLUMN {
            continue; // the description of the entry above, continued
        }
        let text = &line[indent..];
        let names = text.split("  ").next().unwrap();
        while dirs.last().is_some_and(|(i, _)| *i >= indent) {
            dirs.pop();
        }
        let parent = dirs.last().map(|(_, p)| p.clone()).unwrap_or_default();
        let tokens: Vec<&str> =
            names.split([' ', ',']).filter(|t| !t.is_empty()).collect();
        for token in &tokens {
            if !looks_like_path(token) {
                problems.push(format!(
                    "docs/ARCHITECTURE.md module map line {number}: `{token}` is not a path \
                     (names end at the first two spaces; put the description at column \
                     {DESCRIPTION_COLUMN}, or on the next line when the name is long)"
                ));
                continue;
            }
            let full = format!("{parent}{token}");
            if token.contains('*') {
                let (dir, pattern) = match full.rsplit_once('/') {
                    Some((d, p)) => (format!("{d}/"), p.to_string()),
                    None => (String::new(), full.clone()),
                };
                let matches: Vec<String> = fs::read_dir(root().join(&dir))
                    .map(|entries| {
                        entries
                            .filter_map(|e| e.ok())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|n| glob_match(&pattern, n))
                            .map(|n| format!("{dir}{n}"))
                            .collect()
                    })
                    .unwrap_or_default();
                if matches.is_empty() {
                    problems.push(format!(
                        "docs/ARCHITECTURE.md module map line {number}: `{full}` matches no file"
                    ));
                }
                named.extend(matches);
                continue;
            }
            let on_disk = root().join(full.trim_end_matches('/'));
            let exists = if full.ends_with('/') { on_disk.is_dir() } else { on_disk.is_file() };
            if !exists {
                problems.push(format!(
                    "docs/ARCHITECTURE.md module map line {number}: `{full}` does not exist \
                     (moved or removed? update the map)"
                ));
            }
            if full.ends_with('/') && tokens.len() == 1 {
                dirs.push((indent, full.clone()));
            }
            // `codec/tests.rs` names the directory `codec/` too.
            let mut ancestor = full.trim_end_matches('/');
            while let Some((dir, _)) = ancestor.rsplit_once('/') {
                named.insert(format!("{dir}/"));
                ancestor = dir;
            }
            named.insert(full);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    named
}

/// Every file and directory under `dir` (relative to the repository), directories with a
/// trailing `/`.
fn tree(dir: &Path, out: &mut Vec<String>) {
    let mut entries: Vec<_> = fs::read_dir(root().join(dir))
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.unwrap())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let rel = dir.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            out.push(format!("{}/", rel.display()));
            tree(&rel, out);
        } else {
            out.push(rel.display().to_string());
        }
    }
}

#[test]
fn module_map_names_every_file_under_src_and_only_what_exists() {
    let architecture = read("docs/ARCHITECTURE.md");
    let named = named_paths(&module_map_lines(&architecture));
    assert!(named.contains("src/"), "the module map does not start from `src/`");
    let mut files = Vec::new();
    tree(Path::new("src"), &mut files);
    let missing: Vec<_> = files.iter().filter(|f| !named.contains(*f)).collect();
    assert!(
        missing.is_empty(),
        "not in the module map of docs/ARCHITECTURE.md (add each under its directory, with \
         what it is for): {missing:?}"
    );
}

#[test]
fn module_map_parser_refuses_what_it_cannot_read() {
    // The format rules themselves, on a made-up map, so the check above cannot pass by
    // reading nothing.
    let map = "src/\n  lib.rs                crate map\n  nothere.rs            gone\n";
    let lines: Vec<_> = map.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
    let err = std::panic::catch_unwind(|| named_paths(&lines)).unwrap_err();
    let message = err.downcast_ref::<String>().unwrap();
    assert!(message.contains("line 3: `src/nothere.rs` does not exist"), "{message}");

    let map = "src/\n  lib.rs Crate map with one space\n";
    let lines: Vec<_> = map.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
    let err = std::panic::catch_unwind(|| named_paths(&lines)).unwrap_err();
    let message = err.downcast_ref::<String>().unwrap();
    assert!(message.contains("`Crate` is not a path"), "{message}");

    let map = "src/\n  lib.rs                crate map\n  http/\n    mod.rs              loop\n\
               tests/\n  hub_*.rs              hub tests\n";
    let lines: Vec<_> = map.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
    let named = named_paths(&lines);
    for path in ["src/", "src/lib.rs", "src/http/", "src/http/mod.rs", "tests/hub_reads.rs"] {
        assert!(named.contains(path), "{path} not read from the made-up map: {named:?}");
    }
    assert!(!named.contains("http/mod.rs"));
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces to `-`.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Lines outside fenced code blocks.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

fn anchors_of(text: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        if line.starts_with('#') {
            let anchor = anchor_of(line.trim_start_matches('#'));
            // A repeated heading gets -1, -2, … on GitHub.
            let mut candidate = anchor.clone();
            let mut n = 0;
            while !anchors.insert(candidate.clone()) {
                n += 1;
                candidate = format!("{anchor}-{n}");
            }
        }
    }
    anchors
}

/// README.md and the .md files of docs/, docs/benchmarks/, docs/design/ and docs/upstream/.
fn doc_pages() -> Vec<PathBuf> {
    let mut pages = vec![PathBuf::from("README.md")];
    for dir in ["docs", "docs/benchmarks", "docs/design", "docs/upstream"] {
        let mut found: Vec<_> = fs::read_dir(root().join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .map(|p| p.strip_prefix(root()).unwrap().to_path_buf())
            .collect();
        found.sort();
        pages.extend(found);
    }
    pages
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let mut problems = Vec::new();
    let mut links = 0;
    for page in doc_pages() {
        let text = read(page.to_str().unwrap());
        let base = page.parent().unwrap().to_path_buf();
        for (number, line) in prose_lines(&text) {
            let mut rest = line;
            while let Some(at) = rest.find("](") {
                let after = &rest[at + 2..];
                let Some(end) = after.find(')') else { break };
                let target = &after[..end];
                rest = &after[end..];
                if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                    continue;
                }
                links += 1;
                let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
                let file = if path.is_empty() { page.clone() } else { base.join(path) };
                let on_disk = root().join(&file);
                if !on_disk.exists() {
                    problems.push(format!("{}:{number}: `{target}`: no such file", page.display()));
                    continue;
                }
                if !anchor.is_empty() {
                    let anchors = anchors_of(&fs::read_to_string(&on_disk).unwrap_or_default());
                    if !anchors.contains(anchor) {
                        problems.push(format!(
                            "{}:{number}: `{target}`: no heading with that anchor",
                            page.display()
                        ));
                    }
                }
            }
        }
    }
    assert!(links > 50, "only {links} relative links read: is the link reader broken?");
    assert!(problems.is_empty(), "broken links in the docs:\n{}", problems.join("\n"));
}

#[test]
fn readme_is_a_front_door() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, at most {README_MAX_LINES}: put the detail in the docs/ page \
         of its topic (CONFIGURATION, PROTOCOL, OPERATIONS, ARCHITECTURE) and link to it"
    );
    // The two opening commands, first and as they are.
    let first = readme.find("cargo run --release -- --simulate 100").expect("the run command");
    let second = readme.find("bash scripts/test.sh").expect("the test command");
    assert!(first < second && readme[..first].lines().count() < 20, "the two commands come first");
}

#[test]
fn benchmarks_page_is_a_reference() {
    let benchmarks = read("docs/BENCHMARKS.md");
    let lines = benchmarks.lines().count();
    assert!(
        lines <= BENCHMARKS_MAX_LINES,
        "docs/BENCHMARKS.md has {lines} lines, at most {BENCHMARKS_MAX_LINES}: keep one current \
         table per workload there and put a dated run in docs/benchmarks/YYYY-MM-DD-NAME.md, \
         listed under 'Dated runs'"
    );
    // Every dated run is listed on the page, so none is orphaned.
    let mut runs: Vec<String> = fs::read_dir(root().join("docs/benchmarks"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .collect();
    runs.sort();
    assert!(runs.len() >= 20, "only {} dated runs in docs/benchmarks/", runs.len());
    let unlisted: Vec<_> =
        runs.iter().filter(|n| !benchmarks.contains(&format!("(benchmarks/{n})"))).collect();
    assert!(unlisted.is_empty(), "dated runs not linked from docs/BENCHMARKS.md: {unlisted:?}");
    for name in &runs {
        let date = name.get(..11).unwrap_or("");
        let dated = date.len() == 11
            && date.as_bytes()[10] == b'-'
            && date[..10].chars().enumerate().all(|(i, c)| {
                if i == 4 || i == 7 { c == '-' } else { c.is_ascii_digit() }
            });
        assert!(dated, "docs/benchmarks/{name}: a run's page is named YYYY-MM-DD-NAME.md");
    }
}

/// The names of `[dependencies]` and `[dev-dependencies]` in Cargo.toml.
fn cargo_dependencies(manifest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_deps = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]" || line == "[dev-dependencies]";
            continue;
        }
        if in_deps && !line.is_empty() && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                names.push(name.trim().to_string());
            }
        }
    }
    names
}

/// `name` as a whole word of `text` (`tokio` is not mentioned by `tokio-rustls`).
fn mentions(text: &str, name: &str) -> bool {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    text.match_indices(name).any(|(at, _)| {
        !text[..at].chars().next_back().is_some_and(word)
            && !text[at + name.len()..].chars().next().is_some_and(word)
    })
}

#[test]
fn every_dependency_is_in_the_dependencies_table() {
    let architecture = read("docs/ARCHITECTURE.md");
    let start = architecture
        .find("\n## Dependencies")
        .expect("docs/ARCHITECTURE.md has no '## Dependencies' section");
    let section = &architecture[start..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |end| end + 1)];
    let names = cargo_dependencies(&read("Cargo.toml"));
    assert!(names.len() > 30, "only {} dependencies read from Cargo.toml: {names:?}", names.len());
    let missing: Vec<_> = names.iter().filter(|n| !mentions(section, n)).collect();
    assert!(
        missing.is_empty(),
        "Cargo.toml dependencies not in docs/ARCHITECTURE.md's Dependencies (say what each does \
         here): {missing:?}"
    );
}
