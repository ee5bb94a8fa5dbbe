#!/usr/bin/env bash
# Builds the release binaries optimised with a profile of their own hot paths (LLVM's
# profile-guided optimisation, stable in rustc): an instrumented build runs a short training
# workload, llvm-profdata merges what it counted, and the final build lays out and inlines by
# those counts.
#
#   scripts/build-pgo.sh [CARGO_BUILD_ARGS...]      (default: --bins, every binary; the
#                                                   packages must include naam-bench)
#
# Why: an operation through the protocol core's layers in one process runs about 7,800
# instructions spread over some 30 KB of code, more than the core's 32 KB L1 instruction
# cache keeps between operations; callgrind's cache model counts 530 instruction-cache misses
# per operation there (190 on the direct path). Laid out by a profile, hot code sits together
# and cold branches leave it: about 100 misses. bench/RESULTS.md ("Twenty-second session")
# has the figures.
#
# Training: YCSB-B and YCSB-A on MICA and the B-tree, on the in-process cluster directly and
# through the endpoints, reads pinned at the host and steered; and the authentication
# experiment, which runs naam-server's and the client's endpoints over the kernel's loopback
# UDP. About half a minute. The binaries are written under target/pgo/optimised/<host>/release/
# (the build directories are target/pgo/, apart from the ordinary ones).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

log() { printf '[pgo] %s\n' "$*"; }

profdata=${LLVM_PROFDATA:-}
if [ -z "$profdata" ]; then
    for p in /usr/lib/llvm-22/bin/llvm-profdata llvm-profdata-22 llvm-profdata; do
        if command -v "$p" >/dev/null 2>&1; then
            profdata=$(command -v "$p")
            break
        fi
    done
fi
if [ -z "$profdata" ]; then
    echo "build-pgo: llvm-profdata not found (scripts/setup.sh installs LLVM 22; or set LLVM_PROFDATA)" >&2
    exit 2
fi
# The profile's format is LLVM's: llvm-profdata must be of rustc's LLVM major version.
rustc_llvm=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
tool_llvm=$("$profdata" --version | sed -n 's/.*LLVM version \([0-9]*\).*/\1/p' | head -n 1)
if [ -n "$rustc_llvm" ] && [ -n "$tool_llvm" ] && [ "$rustc_llvm" != "$tool_llvm" ]; then
    echo "build-pgo: $profdata is LLVM $tool_llvm, rustc is LLVM $rustc_llvm: their profiles do not mix" >&2
    exit 2
fi

host=$(rustc -vV | sed -n 's/^host: //p')
args=("$@")
if [ "${#args[@]}" -eq 0 ]; then
    args=(--bins)
fi
root=$PWD/target/pgo
raw=$root/raw
rm -rf "$raw"
mkdir -p "$raw"

# An explicit --target keeps RUSTFLAGS off build scripts (and the handler builds they run):
# only the binaries' own code is instrumented, then optimised. Both builds take the same
# packages: cargo unifies features over what one build takes, and code built with other
# features than its profile's does not match it (a build of every binary optimised by a
# profile from naam-bench built alone ran the endpoints' path 14% slower than naam-bench so).
log "instrumented build: cargo build --release ${args[*]}"
RUSTFLAGS="-Cprofile-generate=$raw" cargo build --release --locked --target "$host" \
    --target-dir "$root/instrumented" "${args[@]}"
bench=$root/instrumented/$host/release/naam-bench
if [ ! -x "$bench" ]; then
    echo "build-pgo: the build (cargo build --release ${args[*]}) made no naam-bench, which runs the training" >&2
    exit 2
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
train() {
    log "training: naam-bench $*"
    (cd "$scratch" && "$bench" "$@" >/dev/null 2>"$scratch/stderr") || {
        cat "$scratch/stderr" >&2
        echo "build-pgo: a training run failed: naam-bench $*" >&2
        exit 1
    }
}
for app in mica btree; do
    for fabric in inproc inproc-endpoints; do
        for workload in b a; do
            train ycsb --fabric "$fabric" --placement host --app "$app" --workload "$workload" \
                --records 10000 --ops 200000 --threads 1
        done
        train ycsb --fabric "$fabric" --app "$app" --workload b --records 10000 --ops 100000 \
            --threads 2
    done
done
train experiment auth-cost --rounds 1 --ops 20000 --out "$scratch/auth-cost"

log "merging $(find "$raw" -name '*.profraw' | wc -l) profiles"
"$profdata" merge -o "$root/naam.profdata" "$raw"

log "optimised build: cargo build --release ${args[*]}"
RUSTFLAGS="-Cprofile-use=$root/naam.profdata" cargo build --release --locked --target "$host" \
    --target-dir "$root/optimised" "${args[@]}"
log "done: binaries in $root/optimised/$host/release/"
