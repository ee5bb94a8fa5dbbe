#!/usr/bin/env bash
# The project's test command (README, and .ci/run): installs what a fresh Debian 12 machine
# lacks, then checks formatting, lints, and runs every test. Handlers are built from source when
# the crates that embed them are built (their build scripts); no bytecode is checked in.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

bash scripts/setup.sh
# A clean CI build is never rebuilt incrementally: the incremental caches would only take disk.
if [ -n "${CI:-}" ]; then
    export CARGO_INCREMENTAL=0
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The RDMA verbs backend builds and is linted everywhere; its tests run where a device exists
# and say why they skipped where none does. rdma-sys's bindgen needs libclang 14 (setup.sh).
export LIBCLANG_PATH=/usr/lib/llvm-14/lib
cargo clippy -p naam-runtime -p naam-server -p naam-bench --features naam-server/verbs,naam-bench/verbs --all-targets --locked -- -D warnings
cargo test -p naam-runtime --features verbs --test verbs --locked
# The tokio client is behind naam-runtime's `async` feature (nothing in the workspace turns it
# on): lint it and run the tests that flood through it.
cargo clippy -p naam-runtime --features async --all-targets --locked -- -D warnings
cargo test -p naam-runtime --features async --test cluster --locked
# MICA's and the B-tree's client libraries, without their `host` feature, link naam-proto and
# not the runtime: lint them so, and fail if naam-runtime creeps back into their tree.
cargo clippy -p naam-mica -p naam-btree --no-default-features --all-targets --locked -- -D warnings
cargo test -p naam-mica -p naam-btree --no-default-features --locked
for app in naam-mica naam-btree; do
    tree=$(cargo tree -p "$app" --no-default-features -e normal,build --locked --prefix none)
    if grep -q '^naam-runtime ' <<<"$tree"; then
        echo "error: $app's client library (--no-default-features) depends on naam-runtime" >&2
        exit 1
    fi
done
# The namespace testbed test runs naam-server and naam-nic as processes: build them first.
cargo build --workspace --bins --locked
# bench/tests/standalone.rs copies the release binaries into an empty directory and runs them
# with `env -i` (no toolchain, no source tree): CI tests what users deploy.
cargo build --release --workspace --bins --locked
cargo test --workspace --locked
# The protocol core does no IO: its tests pass with no network at all (a new network
# namespace has not even loopback up). Needs unshare and the right to make namespaces.
# So does a whole deployment over the in-memory datagram network (--fabric inproc-endpoints).
if unshare -n true 2>/dev/null; then
    unshare -n cargo test -p naam-proto --locked --offline
    unshare -n cargo test -p naam-bench --test inproc_endpoints --locked --offline
elif [ -n "${CI:-}" ]; then
    echo "error: CI must run naam-proto's and inproc-endpoints' tests without a network, but unshare -n is not permitted here" >&2
    exit 1
else
    echo "skipped: naam-proto's and inproc-endpoints' tests without a network (unshare -n is not permitted here)"
fi
