//! The operator-side checkers (issue 14), installed by `scripts/operator-tools.sh`: Python
//! tools in a venv (`HUBCAST_TOOLS_VENV`, default `target/tools/venv`), promtool and chromium
//! on PATH. A missing tool fails the test with the command that installs it: never skipped.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A program of the tools venv.
pub fn venv_bin(name: &str) -> PathBuf {
    let venv = std::env::var_os("HUBCAST_TOOLS_VENV").map(PathBuf::from).unwrap_or_else(|| repo().join("target/tools/venv"));
    let path = venv.join("bin").join(name);
    assert!(path.exists(), "{} is missing: run `bash scripts/operator-tools.sh` (scripts/test.sh does)", path.display());
    path
}

/// A program on PATH, or a failure naming the installer.
pub fn on_path(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join(name)).find(|p| p.is_file()))
        .unwrap_or_else(|| panic!("`{name}` is not installed: run `bash scripts/operator-tools.sh` (scripts/test.sh does)"))
}

/// Runs a command to its end; the output is printed (visible with --nocapture or on failure).
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    println!("$ {cmd:?}\n{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    out
}
