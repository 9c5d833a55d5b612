//! What the harness's own tests share: the hubcast binary they spawn.

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/hubcast`, built first if missing. The tests run as
/// `target/<profile>/deps/<test>-<hash>`; `cargo test --workspace` builds the binary, and
/// when only the harness package is tested it is built here.
pub fn hubcast_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>").to_path_buf();
    let bin = profile_dir.join("hubcast");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--bin", "hubcast"]).current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        assert!(cmd.status().expect("cargo build").success(), "cannot build hubcast");
    }
    bin
}
