//! Layers import only downward (issue 10) and no two top-level modules import each other
//! (issue 26): `scripts/layers.py` checks every `crate::` path of src/ against
//! `scripts/layers.toml`, with today's known wrong-way imports and cycles listed in
//! `scripts/layers-baseline.txt` (a ratchet: the list only shrinks). Its own self-test runs
//! first, so a check that passes everything cannot pass here.

use std::process::Command;

fn python(script: &str) -> (bool, String) {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .arg(format!("{root}/scripts/{script}"))
        .current_dir(root)
        .output()
        .expect("python3 runs (scripts/test.sh installs it on a fresh machine)");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_layer_check_catches_an_upward_import_and_a_cycle() {
    let (ok, out) = python("test_layers.py");
    assert!(ok, "{out}");
}

#[test]
fn src_imports_only_downward_beyond_the_baseline() {
    let (ok, out) = python("layers.py");
    assert!(ok, "{out}");
    eprintln!("{out}");
}
