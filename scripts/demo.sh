#!/usr/bin/env bash
# The main job: a short YCSB-B run on MICA over the embedded in-process cluster, then the
# steering demo (host cores congested for a second). Mode inproc: NIC cores, DMA and one-sided
# RDMA are emulated in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

bash scripts/setup.sh
cargo build --release --locked --workspace --bins   # naam, naam-bench, naam-server, naam-nic
mkdir -p bench/out
echo "== YCSB-B on MICA (in-process cluster)"
target/release/naam-bench ycsb -P workloads/workloadb -p recordcount=10000 \
  -p operationcount=200000 --json bench/out/ycsb-b-mica.json
echo "== steering under host congestion (naam demo)"
target/release/naam demo --seconds 3
