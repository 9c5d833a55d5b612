#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of every parser of untrusted input (docs/FUZZING.md): builds
# the targets of fuzz/ with the nightly toolchain and cargo-fuzz (installed if missing), runs
# each for FUZZ_SECONDS (default 20) from its seed corpus in fuzz/corpus/, and fails on the
# first crash (the input is kept in fuzz/artifacts/<target>/, the reproduction is printed).
# New inputs libFuzzer finds go to a scratch directory, never into the tree.
#
#   scripts/fuzz.sh                        # every target, 20 s each, optimized build
#   FUZZ_SECONDS=600 scripts/fuzz.sh amqp    # one target, longer
#   FUZZ_BUILD=--dev scripts/fuzz.sh         # unoptimized build (CI: half the build's CPU
#                                            # time, ~15x fewer execs per second)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-20}
build=${FUZZ_BUILD:--O}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(json http engine_io amqp store)

rustup run nightly rustc --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
# The dependency versions of the product (fuzz/ is a workspace of its own).
cp Cargo.lock fuzz/Cargo.lock

started=$(date +%s)
if [ $# -eq 0 ]; then
    cargo +nightly fuzz build "$build"
else
    for t in "${targets[@]}"; do cargo +nightly fuzz build "$build" "$t"; done
fi
echo "fuzz: built in $(( $(date +%s) - started )) s"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t"
    log="$scratch/$t.log"
    echo "fuzz: $t for ${seconds} s"
    # One process (no -jobs: its output would go to fuzz-N.log); the first directory takes
    # what libFuzzer finds, the seeds are only read.
    if ! cargo +nightly fuzz run "$build" "$t" "$scratch/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -print_final_stats=1 >"$log" 2>&1; then
        tail -n 80 "$log"
        echo "fuzz: target $t failed; the crashing input is in fuzz/artifacts/$t/ (add it to fuzz/corpus/$t/ with the fix)" >&2
        exit 1
    fi
    grep -E '^#[0-9]+[[:space:]]+DONE|stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' "$log" || tail -n 5 "$log"
done
echo "fuzz: done in $(( $(date +%s) - started )) s"
