#!/usr/bin/env bash
# Installs everything NAAM-rs needs on a fresh Debian 12 (bookworm) machine.
# Idempotent: every step checks first and skips what is already present.
#
#   - LLVM 22 development files (bookworm-security), which bpf-linker links against;
#   - clang-22, used by tests that build C handlers with `clang -target bpf`;
#   - memcached, the baseline naam-bench starts and stops on loopback (never left running);
#   - fonts-dejavu-core, the font naam-bench renders plot text with;
#   - iproute2, which scripts/testbed.sh builds the network-namespace testbed with;
#   - libibverbs-dev and librdmacm-dev (rdma-core), which the `verbs` backend links, and
#     libclang1-14 for rdma-sys's bindgen 0.59 (it cannot parse LLVM 22's anonymous names);
#   - gcc-aarch64-linux-gnu (with its static libc), which cross-compiles the harness that runs
#     the JIT's aarch64 code, and qemu-user, which runs it: BlueField-2's Arm cores, emulated;
#   - bpf-linker 0.13 (built from crates.io against LLVM 22), the last step of the
#     Rust-to-eBPF handler pipeline (see DESIGN.md section 3);
#   - redis-server and redis-tools (redis-cli, redis-benchmark), the real RESP peers that tests
#     drive naam-server's RESP front end with and the baseline its benchmark compares against;
#   - python3-venv, and in target/pytools a virtual environment with hdrhistogram 0.10.8
#     (PyPI), HdrHistogram's Python reader, which a test reads naam-bench's interval logs with,
#     and prometheus-client 0.21.1 (PyPI), whose parser a test reads naam-server's metrics with,
#     and redis 8.1.0 (PyPI, redis-py), the single-node and cluster client a test drives NAAM with.
set -euo pipefail

log() { printf '[setup] %s\n' "$*"; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

APT_PACKAGES=(llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev clang-22 pkg-config memcached fonts-dejavu-core iproute2 libibverbs-dev librdmacm-dev libclang1-14 gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user python3-venv redis-server redis-tools)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  log "Debian packages present"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "[setup] error: cargo not found; install the Rust 1.95 toolchain first" >&2
  exit 1
fi

BPF_LINKER_VERSION="0.13.0"
if command -v bpf-linker >/dev/null 2>&1 && bpf-linker --version 2>/dev/null | grep -q "$BPF_LINKER_VERSION"; then
  log "bpf-linker $BPF_LINKER_VERSION present"
else
  log "building bpf-linker $BPF_LINKER_VERSION against LLVM 22 (about 2 minutes)"
  LLVM_PREFIX=/usr/lib/llvm-22 LLVM_SYS_221_PREFIX=/usr/lib/llvm-22 \
    cargo install "bpf-linker@$BPF_LINKER_VERSION" --locked --no-default-features --features llvm-22
fi
PYTOOLS="$(pwd)/target/pytools"
if [ -x "$PYTOOLS/bin/python" ] && "$PYTOOLS/bin/python" -c 'import hdrh, prometheus_client, redis' 2>/dev/null; then
  log "python hdrhistogram, prometheus-client and redis present"
else
  log "installing hdrhistogram 0.10.8, prometheus-client 0.21.1 and redis 8.1.0 (PyPI) into $PYTOOLS"
  python3 -m venv "$PYTOOLS"
  "$PYTOOLS/bin/python" -m pip install --quiet --disable-pip-version-check \
    "hdrhistogram==0.10.8" "prometheus-client==0.21.1" "redis==8.1.0"
fi
log "done"
