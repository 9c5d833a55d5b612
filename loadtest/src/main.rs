//! `hubcast-load`: see the crate documentation and docs/BENCHMARKS.md.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = hubcast_load::cli::Cli::parse();
    match hubcast_load::run(cli) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hubcast-load: {e}");
            ExitCode::FAILURE
        }
    }
}
