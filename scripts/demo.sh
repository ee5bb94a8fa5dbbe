#!/usr/bin/env bash
# Builds the example handlers with the Rust-to-eBPF pipeline, verifies them, and runs a few on
# both engines. The YCSB main job replaces this once the runtime, apps and bench land.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

bash scripts/setup.sh
cargo build --release --locked -p naam-runtime --bin naam
naam=target/release/naam
obj=target/naam/examples.o
$naam build examples/handlers -o "$obj"
echo "== naam verify $obj"
$naam verify "$obj"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -c "import struct; open('$tmp/sorted.bin','wb').write(b''.join(struct.pack('<Q', 3*i) for i in range(128)))"
for engine in interp jit; do
  echo "== add 5 + 7 ($engine)"
  $naam run "$obj" --handler add --args-hex 05000000000000000700000000000000 --engine $engine --repeat 100000
  echo "== binary search for 42 in 0, 3, 6, ... ($engine)"
  $naam run "$obj" --handler bsearch --args-hex 2a00000000000000 --segment "$tmp/sorted.bin" --engine $engine --repeat 10000
  echo "== a panicking handler aborts cleanly ($engine)"
  $naam run "$obj" --handler panics --args-hex 0700000000000000 --engine $engine || echo "(exit $?: aborted as expected)"
done
echo "== the in-process cluster under host congestion (naam demo)"
$naam demo --object "$obj" --seconds 3
