#!/usr/bin/env bash
# The multi-host testbed on one machine: two network namespaces (client, server) joined by a
# veth pair with a jumbo MTU, naam-server and naam-nic running in the server namespace.
#
#   scripts/testbed.sh up        create namespaces, start naam-server and naam-nic
#   scripts/testbed.sh down      stop everything, delete namespaces and shared memory
#   scripts/testbed.sh status    what exists and what runs
#   scripts/testbed.sh client CMD...    run CMD in the client namespace
#   scripts/testbed.sh kill-nic [SIG]   signal naam-nic (default KILL); waits until it has exited
#                                       (not for STOP/CONT)
#   scripts/testbed.sh start-nic        (re)start naam-nic
#   scripts/testbed.sh kill-server [SIG], start-server   the same for naam-server
#   scripts/testbed.sh keys             make (once) and print the credentials directory
#   scripts/testbed.sh netem LOSS%      packet loss on both veth ends ("off" removes it); needs
#                                       sch_netem in the kernel (NAAM_INJECT_LOSS=0.01 at `up`
#                                       and in the client injects loss in the sockets instead)
#
# Needs root (network namespaces) and iproute2. Addresses live only inside the namespaces
# created here. Environment: NAAM_TESTBED (name prefix, default naam), NAAM_SUBNET (default
# 10.77.0), NAAM_BIN_DIR (default target/release, built if missing), NAAM_SERVER_POLICY (auto),
# NAAM_DATAGRAM (8972), NAAM_XDP (1: attach the XDP eSwitch to the server veth; 0: the
# user-space switch steers), NAAM_SCALE_APPS (0: extra small MICA apps for
# `naam-bench experiment scale --fabric udp`, ids 1000 and up). The server allows congestion
# control (experiments slow its host executors on purpose; only the client namespace reaches
# it). `up` tears everything down again if any step fails.
set -euo pipefail

cd "$(dirname "$0")/.."
NAME=${NAAM_TESTBED:-naam}
SUBNET=${NAAM_SUBNET:-10.77.0}
CLI_NS=$NAME-cli
SRV_NS=$NAME-srv
SRV_IF=$NAME-s0
CLI_IF=$NAME-c0
SRV_IP=$SUBNET.1
CLI_IP=$SUBNET.2
STATE=${NAAM_TESTBED_DIR:-/tmp/$NAME-testbed}
SHM=/dev/shm/$NAME-testbed
BIN=${NAAM_BIN_DIR:-target/release}
POLICY=${NAAM_SERVER_POLICY:-auto}
DATAGRAM=${NAAM_DATAGRAM:-8972}
SERVER_ADDR=$SRV_IP:7000
NIC_ADDR=$SRV_IP:7001

say() { echo "testbed: $*" >&2; }
die() { say "error: $*"; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "network namespaces need root (run as root or with sudo)"
    command -v ip >/dev/null || die "iproute2 (ip) is not installed"
}

binaries() {
    if [ ! -x "$BIN/naam-server" ] || [ ! -x "$BIN/naam-nic" ] || [ ! -x "$BIN/naam-bench" ]; then
        [ "$BIN" = target/release ] || die "no naam-server/naam-nic/naam-bench in $BIN"
        say "building release binaries"
        cargo build --release --locked -q -p naam-server -p naam-smartnic -p naam-bench
    fi
}

# Whether a process has exited: gone, or a zombie (whose sockets are already closed; a
# container's init may never reap it). Waits up to the given seconds (0: just looks).
exited() { # pid seconds
    # Every thread of it, not only the first: a killed process keeps its sockets until its
    # last thread has exited, and a thread of the lowest priority (naam-jit) may come last.
    local i=0 st t alive
    while :; do
        alive=0
        for t in /proc/"$1"/task/*/stat; do
            [ -e "$t" ] || continue
            st=$(sed 's/^.*) //' "$t" 2>/dev/null | cut -d' ' -f1) || true
            [ -z "$st" ] || [ "$st" = Z ] || alive=1
        done
        [ "$alive" = 0 ] && return 0
        ((i++ < $2 * 10)) || return 1
        sleep 0.1
    done
}

# Waits until the log shows the pattern. Gives up early when the process named by the pid
# file has exited (a server that cannot bind says so at once, not after the whole wait).
wait_for() { # file pattern seconds [pidfile]
    local i pid
    for ((i = 0; i < $3 * 10; i++)); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        pid=$(cat "${4:-/dev/null}" 2>/dev/null) || true
        if [ -n "$pid" ] && exited "$pid" 0; then
            grep -q "$2" "$1" 2>/dev/null
            return
        fi
        sleep 0.1
    done
    return 1
}

# Credentials of the testbed's tenants, NIC and operator, made once per state directory
# (clients started with `client` find them through NAAM_KEYS).
keys() {
    mkdir -p "$STATE/keys"
    chmod 700 "$STATE/keys"
    local k
    for k in mica btree naam-nic naam-operator; do
        [ -f "$STATE/keys/$k.key" ] || "$BIN/naam-server" keygen --out "$STATE/keys/$k.key" 2>/dev/null
    done
}

# Refuses to start a second copy: its pid file would hide the one still running.
not_running() { # pidfile name
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    [ -z "$pid" ] || exited "$pid" 0 || die "$2 is already running (pid $pid); kill it first"
}

start_nic() {
    not_running "$STATE/nic.pid" naam-nic
    rm -f "$STATE/nic.pid"
    # The log ends with how naam-nic exited (a signal shows as 128 + its number).
    (
        ip netns exec "$SRV_NS" "$BIN/naam-nic" run --server "$SERVER_ADDR" --listen "$NIC_ADDR" \
            --shm-dir "$SHM" --datagram "$DATAGRAM" --pairing "$STATE/keys/naam-nic.key" &
        echo $! >"$STATE/nic.pid"
        wait $! && st=0 || st=$?
        echo "testbed: naam-nic exited with status $st"
    ) >"$STATE/nic.log" 2>&1 &
    wait_for "$STATE/nic.log" "agent and executors on" 30 "$STATE/nic.pid" || {
        cat "$STATE/nic.log" >&2
        die "naam-nic did not start"
    }
    say "naam-nic up on $NIC_ADDR (pid $(cat "$STATE/nic.pid"))"
}

# Extra arguments go to naam-server: `up` starts a fresh testbed with --reset-regions (its
# config may size the apps anew); `start-server` after a kill takes up the regions the last
# server left, data and all.
start_server() {
    not_running "$STATE/server.pid" naam-server
    local attempt
    for attempt in 1 2 3 4 5; do
        ip netns exec "$SRV_NS" "$BIN/naam-server" --config "$STATE/naam-server.toml" "$@" \
            >"$STATE/server.log" 2>&1 &
        echo $! >"$STATE/server.pid"
        wait_for "$STATE/server.log" "serving" 600 "$STATE/server.pid" && break
        # The address of a server just killed may still be held while its sockets go.
        if [ "$attempt" -lt 5 ] && grep -q "Address already in use" "$STATE/server.log"; then
            say "the listen address is still held (a killed server's sockets): trying again"
            sleep 1
            continue
        fi
        cat "$STATE/server.log" >&2
        die "naam-server did not start"
    done
    say "naam-server up on $SERVER_ADDR (pid $(cat "$STATE/server.pid"))"
    grep -E "eSwitch" "$STATE/server.log" | sed 's/^/testbed: /' >&2 || true
}

up() {
    need_root
    binaries
    if ip netns list | grep -qw "$SRV_NS"; then die "testbed $NAME is already up (down first)"; fi
    trap 'say "setup failed; tearing down"; down' ERR
    mkdir -p "$STATE"
    keys
    ip netns add "$CLI_NS"
    ip netns add "$SRV_NS"
    ip link add "$CLI_IF" type veth peer name "$SRV_IF"
    ip link set "$CLI_IF" netns "$CLI_NS"
    ip link set "$SRV_IF" netns "$SRV_NS"
    ip -n "$CLI_NS" link set "$CLI_IF" mtu 9000 up
    ip -n "$SRV_NS" link set "$SRV_IF" mtu 9000 up
    ip -n "$CLI_NS" link set lo up
    ip -n "$SRV_NS" link set lo up
    ip -n "$CLI_NS" addr add "$CLI_IP/24" dev "$CLI_IF"
    ip -n "$SRV_NS" addr add "$SRV_IP/24" dev "$SRV_IF"
    cat >"$STATE/naam-server.toml" <<CONF
listen = "$SERVER_ADDR"
shm_dir = "$SHM"
policy = "$POLICY"
datagram = $DATAGRAM
nic_port = ${NIC_ADDR##*:}
allow_congestion_control = true
nic_pairing = "keys/naam-nic.key"
operator_credential = "keys/naam-operator.key"
$( [ "${NAAM_XDP:-1}" = 0 ] || echo "xdp_interface = \"$SRV_IF\"" )

[[app]]
kind = "mica"
id = 1
credential = "keys/mica.key"
items = ${NAAM_MICA_ITEMS:-200000}

[[app]]
kind = "btree"
id = 2
credential = "keys/btree.key"
keys = ${NAAM_BTREE_KEYS:-200000}
$( [ "${NAAM_SCALE_APPS:-0}" = 0 ] || printf '\n[[app]]\nkind = "mica"\nid = 1000\ncredential = "keys/mica.key"\nitems = 32\nkey_cap = 8\nvalue_cap = 8\ninstances = %s\n' "$NAAM_SCALE_APPS" )
CONF
    [ -z "${NAAM_INJECT_LOSS:-}" ] || say "injecting ${NAAM_INJECT_LOSS} datagram loss in every socket"
    start_server --reset-regions
    start_nic
    trap - ERR
    say "up: client namespace $CLI_NS ($CLI_IP), server namespace $SRV_NS ($SRV_IP); MTU 9000"
    say "try: scripts/testbed.sh client $BIN/naam-bench ycsb --fabric udp --server $SERVER_ADDR"
}

# Signals naam-nic or naam-server. A signal that ends the process is waited for, so a
# restart right after it finds the address free (a killed process holding a large table can
# take a while to release it).
signal_pid() { # pidfile signal
    [ -f "$1" ] || die "$1: no such pid file (is the testbed up?)"
    local pid
    pid=$(cat "$1")
    kill -"$2" "$pid" || die "cannot signal $pid with $2"
    case "$2" in
    STOP | SIGSTOP | 19 | CONT | SIGCONT | 18) ;;
    *) exited "$pid" 30 || die "pid $pid still running 30 s after SIG$2" ;;
    esac
}

stop_pid() { # pidfile
    [ -f "$1" ] || return 0
    local pid
    pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        exited "$pid" 5 || { kill -KILL "$pid" 2>/dev/null || true; exited "$pid" 30 || true; }
    fi
    rm -f "$1"
}

down() {
    need_root
    stop_pid "$STATE/nic.pid"
    stop_pid "$STATE/server.pid"
    # Anything else still running inside the namespaces.
    for ns in "$CLI_NS" "$SRV_NS"; do
        if ip netns list | grep -qw "$ns"; then
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
    ip link del "$CLI_IF" 2>/dev/null || true
    rm -rf "$SHM"
    say "down"
}

status() {
    local ok=0
    for ns in "$CLI_NS" "$SRV_NS"; do
        if ip netns list | grep -qw "$ns"; then say "namespace $ns: present"; else say "namespace $ns: absent"; ok=1; fi
    done
    ip -n "$SRV_NS" -br addr show "$SRV_IF" 2>/dev/null || true
    ip -n "$CLI_NS" -br addr show "$CLI_IF" 2>/dev/null || true
    for p in server nic; do
        if [ -f "$STATE/$p.pid" ] && kill -0 "$(cat "$STATE/$p.pid")" 2>/dev/null; then
            say "naam-$p: running (pid $(cat "$STATE/$p.pid"))"
        else
            say "naam-$p: not running"
            ok=1
        fi
    done
    return $ok
}

netem() {
    need_root
    if [ "$1" = off ]; then
        ip netns exec "$CLI_NS" tc qdisc del dev "$CLI_IF" root 2>/dev/null || true
        ip netns exec "$SRV_NS" tc qdisc del dev "$SRV_IF" root 2>/dev/null || true
        say "netem off"
    else
        command -v tc >/dev/null || die "tc (iproute2) is not installed"
        if ! ip netns exec "$CLI_NS" tc qdisc replace dev "$CLI_IF" root netem loss "$1" 2>/dev/null; then
            die "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); inject loss in the sockets instead: NAAM_INJECT_LOSS=0.01 scripts/testbed.sh up, and NAAM_INJECT_LOSS=0.01 for the client"
        fi
        ip netns exec "$SRV_NS" tc qdisc replace dev "$SRV_IF" root netem loss "$1"
        say "netem: $1 loss each way"
    fi
}

case "${1:-}" in
up) up ;;
down) down ;;
status) status ;;
client) shift; need_root; exec ip netns exec "$CLI_NS" env NAAM_KEYS="$STATE/keys" "$@" ;;
kill-nic) need_root; signal_pid "$STATE/nic.pid" "${2:-KILL}" ;;
start-nic) need_root; start_nic ;;
kill-server) need_root; signal_pid "$STATE/server.pid" "${2:-KILL}" ;;
start-server) need_root; start_server ;;
keys) keys; echo "$STATE/keys" ;;
netem) need_root; netem "${2:?netem needs a loss like 1% or off}" ;;
addr) echo "$SERVER_ADDR" ;;
*) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
