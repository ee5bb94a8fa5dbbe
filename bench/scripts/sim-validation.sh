#!/usr/bin/env bash
# The simulator's validation on this machine (bench/RESULTS.md, "The simulator"): YCSB-B over
# UDP against naam-server and naam-nic on loopback (one MICA app), one and two client threads,
# unthrottled and paced at 20,000 and 40,000 ops/s, a fresh server per run, ROUNDS rounds in
# turn; then the same six runs simulated with a profile (default: bench/profiles/this-machine.toml,
# written by `naam-bench sim calibrate`). Prints the medians side by side with their ratios.
#
#   bench/scripts/sim-validation.sh [ROUNDS] [PROFILE]
#
# Needs target/release/{naam-server,naam-nic,naam-bench} (cargo build --release -p naam-server
# -p naam-smartnic -p naam-bench). Uses 127.0.0.1:7000 and :7001 and a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-5}
profile=${2:-bench/profiles/this-machine.toml}
bin=target/release
for b in naam-server naam-nic naam-bench; do
    [ -x "$bin/$b" ] || { echo "sim-validation: $bin/$b missing (build it first)" >&2; exit 2; }
done
work=$(mktemp -d)
server_pid=""
nic_pid=""
stop_servers() {
    [ -n "$nic_pid" ] && kill "$nic_pid" 2>/dev/null && wait "$nic_pid" 2>/dev/null || true
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
    nic_pid=""
    server_pid=""
}
trap 'stop_servers; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
mkdir -m 700 "$work/keys"
for k in mica naam-nic naam-operator; do
    "$bin/naam-server" keygen --out "$work/keys/$k.key" >/dev/null
done
cat >"$work/server.toml" <<EOF
listen = "127.0.0.1:7000"
shm_dir = "$work/shm"
host_executors = 1
policy = "auto"
nic_pairing = "keys/naam-nic.key"
operator_credential = "keys/naam-operator.key"

[[app]]
kind = "mica"
id = 1
credential = "keys/mica.key"
items = 20000
key_cap = 24
value_cap = 1000
EOF

start_servers() {
    "$bin/naam-server" --config "$work/server.toml" -qq &
    server_pid=$!
    "$bin/naam-nic" run --server 127.0.0.1:7000 --listen 127.0.0.1:7001 \
        --pairing "$work/keys/naam-nic.key" --shm-dir "$work/shm" -qq &
    nic_pid=$!
    sleep 1
}

configs=("1 none" "1 20000" "1 40000" "2 none" "2 20000" "2 40000")
ycsb=(--fabric udp --server 127.0.0.1:7000 --app mica --workload b --keys "$work/keys"
    -p recordcount=10000 -p operationcount=60000)
for r in $(seq 1 "$rounds"); do
    for i in "${!configs[@]}"; do
        read -r t target <<<"${configs[$i]}"
        pace=()
        [ "$target" != none ] && pace=(--target "$target")
        start_servers
        "$bin/naam-bench" ycsb load "${ycsb[@]}" --threads 1 >/dev/null 2>&1
        "$bin/naam-bench" ycsb run "${ycsb[@]}" --threads "$t" "${pace[@]}" \
            >"$work/measured-$i-$r.txt" 2>/dev/null
        stop_servers
    done
done
for i in "${!configs[@]}"; do
    read -r t target <<<"${configs[$i]}"
    pace=()
    [ "$target" != none ] && pace=(--target "$target")
    "$bin/naam-bench" sim run --profile "$profile" --clients "$t" --records 10000 \
        --measure-ms 300 --warmup-ms 20 "${pace[@]}" >"$work/simulated-$i.json" 2>/dev/null
done
python3 - "$work" "$rounds" "${configs[@]}" <<'EOF'
import json, re, statistics, sys
work, rounds, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def measured(path):
    text = open(path).read()
    tput = float(re.search(r"\[OVERALL\], Throughput\(ops/sec\), ([0-9.]+)", text).group(1))
    read = float(re.search(r"\[READ\], AverageLatency\(us\), ([0-9.]+)", text).group(1))
    return tput, read
print("| threads | target | measured ops/s | simulated | ratio | measured READ mean | simulated | ratio |")
print("|---|---|---|---|---|---|---|---|")
for i, c in enumerate(configs):
    t, target = c.split()
    runs = [measured(f"{work}/measured-{i}-{r}.txt") for r in range(1, rounds + 1)]
    mt = statistics.median(x[0] for x in runs)
    mr = statistics.median(x[1] for x in runs)
    s = json.load(open(f"{work}/simulated-{i}.json"))
    st, sr = s["throughput_ops"], s["read_latency"]["mean_us"]
    print(f"| {t} | {target} | {mt:,.0f} | {st:,.0f} | {st / mt:.2f} | {mr:.1f} us | {sr:.1f} us | {sr / mr:.2f} |")
EOF
