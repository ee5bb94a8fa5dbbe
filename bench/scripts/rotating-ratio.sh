#!/usr/bin/env bash
# Time per operation through the endpoints against the direct path, and a build against a
# base, measured in the same rounds on a noisy machine.
#
#   bench/scripts/rotating-ratio.sh BASE AFTER ROUNDS THREADS [ENDPOINT_OPS [DIRECT_OPS]]
#
# BASE and AFTER are two naam-bench binaries (`cargo build --release -p naam-bench`, copied
# aside). Each round runs MICA YCSB-B (10,000 records, reads pinned at the host) three ways:
# BASE through the endpoints (`--fabric inproc-endpoints`), AFTER through the endpoints, and
# AFTER directly (`--fabric inproc`); the order rotates from round to round, so that a
# machine whose speed drifts favours none of the three. Runs are short (ENDPOINT_OPS, default
# 250,000, and DIRECT_OPS, default 500,000) so that a round falls within one of the machine's
# moods. Prints each round's throughputs and ratios, then the median and quartiles of:
# direct/BASE, direct/AFTER (the time per operation against the direct path) and AFTER/BASE
# (throughput).
set -euo pipefail

if [ $# -lt 4 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
base=$1 after=$2 rounds=$3 threads=$4
endpoint_ops=${5:-250000} direct_ops=${6:-500000}
for n in "$rounds" "$threads" "$endpoint_ops" "$direct_ops"; do
    case $n in '' | *[!0-9]* | 0)
        echo "rotating-ratio: ROUNDS, THREADS and the operation counts are positive integers" >&2
        exit 2
        ;;
    esac
done
for b in "$base" "$after"; do
    [ -x "$b" ] || { echo "rotating-ratio: $b is not an executable" >&2; exit 2; }
done

# Throughput (ops/s) of one run: BIN FABRIC OPS.
run() {
    "$1" ycsb --fabric "$2" --placement host --app mica --workload b --records 10000 \
        --ops "$3" --threads "$threads" 2>/dev/null |
        awk -F', ' '/\[OVERALL\], Throughput/ { printf "%.0f", $3 }'
}

rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
echo "round base_endpoints after_endpoints after_direct direct/base direct/after after/base"
for r in $(seq 1 "$rounds"); do
    case $((r % 3)) in
    0)
        a=$(run "$base" inproc-endpoints "$endpoint_ops")
        b=$(run "$after" inproc-endpoints "$endpoint_ops")
        d=$(run "$after" inproc "$direct_ops")
        ;;
    1)
        b=$(run "$after" inproc-endpoints "$endpoint_ops")
        d=$(run "$after" inproc "$direct_ops")
        a=$(run "$base" inproc-endpoints "$endpoint_ops")
        ;;
    *)
        d=$(run "$after" inproc "$direct_ops")
        a=$(run "$base" inproc-endpoints "$endpoint_ops")
        b=$(run "$after" inproc-endpoints "$endpoint_ops")
        ;;
    esac
    if [ -z "$a" ] || [ -z "$b" ] || [ -z "$d" ]; then
        echo "rotating-ratio: round $r: a run printed no throughput" >&2
        exit 1
    fi
    awk -v r="$r" -v a="$a" -v b="$b" -v d="$d" \
        'BEGIN { printf "%d %s %s %s %.3f %.3f %.3f\n", r, a, b, d, d / a, d / b, b / a }' |
        tee -a "$rows"
done
for col in 5 6 7; do
    name=$(echo "direct/base direct/after after/base" | cut -d' ' -f$((col - 4)))
    awk -v c="$col" '{ print $c }' "$rows" | sort -n |
        awk -v name="$name" '{ v[NR] = $1 } END {
            printf "%-12s median %.3f  quartiles %.3f %.3f  range %.3f-%.3f\n", name,
                (v[int((NR + 1) / 2)] + v[int((NR + 2) / 2)]) / 2,
                v[int(NR / 4) + 1], v[int(3 * NR / 4) + (NR < 4)], v[1], v[NR] }'
done
