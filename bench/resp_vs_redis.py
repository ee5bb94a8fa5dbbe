#!/usr/bin/env python3
"""naam-server's RESP front against Debian's redis-server, with the same client (redis-benchmark).

    python3 bench/resp_vs_redis.py [--rounds 3] [--bin target/release] [--points 16:50,1:8]
    python3 bench/resp_vs_redis.py --baseline OTHER/naam-server   # an A/B of two builds

Starts, on loopback and in a temporary directory, one naam-server per RESP path (`udp`: the
front's commands are datagrams to the server's own UDP port, steered like any client's;
`inline`: handed to an endpoint in the process and run in the front's thread) and one
redis-server (no persistence: `--save "" --appendonly no`). Then, in alternating rounds (the
order of the targets rotates every round), runs

    redis-benchmark -t set,get -d 1024 -r 100000 -P {1,16} -c {1,8,50} --csv

against each, and a three-node cluster of each (three naam-servers with a cluster file; three
redis-servers joined by `redis-cli --cluster create`) driven by `redis-benchmark --cluster`.
Prints a Markdown table of the median requests per second, p99 latency and the server's CPU
time per request (every thread of the server process, from /proc; SET and GET are run as two
invocations so each has its own) per point, and NAAM's ratio to redis-server. Everything it starts it stops; every run is bounded by -n.

Needs redis-server, redis-cli and redis-benchmark (scripts/setup.sh installs them) and
release builds of naam-server (`cargo build --release -p naam-server`).
"""

import argparse
import csv
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

POINTS = [(p, c) for p in (1, 16) for c in (1, 8, 50)]
# Requests per test: enough for a second or more at each point, bounded. A cluster's runs
# take five times as many: with these, three nodes finished in about 0.5 s, and the rates
# came out quantised by redis-benchmark's millisecond clock.
REQUESTS = {1: 30000, 16: 200000}
CLUSTER_FACTOR = 5


def free_port():
    """A loopback port free for TCP and UDP whose cluster bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind(("127.0.0.1", port))
            with socket.socket() as t:
                t.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


def wait_tcp(port, proc, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not listen on {port} within {timeout} s")


class Naam:
    """One naam-server with a MICA table of 1 KB values and a RESP front."""

    def __init__(self, binary, work, path, cluster=None, ports=None, key=None):
        self.dir = tempfile.mkdtemp(dir=work)
        if key:
            # A cluster's nodes share the tenant's credential, as its clients AUTH once.
            shutil.copy(key, f"{self.dir}/mica.key")
            os.chmod(f"{self.dir}/mica.key", 0o600)
        else:
            subprocess.run([binary, "keygen", "--out", f"{self.dir}/mica.key"], check=True,
                           stderr=subprocess.DEVNULL)
        with open(f"{self.dir}/mica.key") as f:
            self.password = f.read().strip()
        self.resp, self.udp = ports or (free_port(), free_port())
        config = (f'listen = "127.0.0.1:{self.udp}"\nresp_listen = "127.0.0.1:{self.resp}"\n'
                  f'resp_path = "{path}"\nreceive_loops = 1\nshm_dir = "/dev/shm/naam-bench-{self.resp}"\n')
        if cluster:
            with open(f"{self.dir}/cluster.toml", "w") as f:
                f.write(cluster)
            config += 'resp_cluster = "cluster.toml"\n'
        config += ('[[app]]\nkind = "mica"\nid = 1\ncredential = "mica.key"\n'
                   'items = 300000\nkey_cap = 32\nvalue_cap = 1100\n')
        with open(f"{self.dir}/naam-server.toml", "w") as f:
            f.write(config)
        self.proc = subprocess.Popen(
            [binary, "--config", f"{self.dir}/naam-server.toml", "--reset-regions", "-q"],
            cwd=self.dir, stdout=subprocess.DEVNULL, stderr=open(f"{self.dir}/log", "w"))
        wait_tcp(self.resp, self.proc, "naam-server")

    def auth(self):
        return ["--user", "mica", "-a", self.password]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=20)
        shutil.rmtree(f"/dev/shm/naam-bench-{self.resp}", ignore_errors=True)


class Redis:
    def __init__(self, work, cluster=False, port=None):
        self.resp = port or free_port()
        d = tempfile.mkdtemp(dir=work)
        args = ["redis-server", "--port", str(self.resp), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", d, "--protected-mode", "no"]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"{d}/nodes.conf"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_tcp(self.resp, self.proc, "redis-server")

    def auth(self):
        return []

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=20)


def cpu_ns(pid):
    """Nanoseconds every thread of process `pid` has run, from /proc (schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended in between
    return total


def benchmark(port, auth, p, c, cluster=False, pid=None):
    """{test: (rps, p99 ms, server CPU us per request or None)} of one SET run then one GET
    run (as `-t set,get` runs them), the server's CPU read around each when `pid` is given."""
    n = REQUESTS[p] * (CLUSTER_FACTOR if cluster else 1)
    result = {}
    for test in ("set", "get"):
        args = ["redis-benchmark", "-p", str(port), *auth, "-t", test, "-d", "1024",
                "-r", "100000", "-P", str(p), "-c", str(c), "-n", str(n), "--csv"]
        if cluster:
            args.insert(1, "--cluster")
        before = cpu_ns(pid) if pid else None
        out = subprocess.run(args, capture_output=True, text=True, timeout=600)
        cpu = (cpu_ns(pid) - before) / n / 1000 if pid else None
        rows = [r for r in csv.reader(io.StringIO(out.stdout)) if r and r[0] == test.upper()]
        if len(rows) != 1 or "rror" in out.stdout + out.stderr:
            sys.exit(f"redis-benchmark {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        result[test.upper()] = (float(rows[0][1]), float(rows[0][6]), cpu)
    return result


def cluster_file(nodes):
    ranges = ["0-5460", "5461-10922", "10923-16383"]
    return "".join(
        f'[[node]]\nresp = "127.0.0.1:{r}"\nnaam = "127.0.0.1:{u}"\nslots = ["{s}"]\n'
        for (r, u), s in zip(nodes, ranges))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bin", default="target/release")
    ap.add_argument("--no-cluster", action="store_true", help="skip the three-node clusters")
    ap.add_argument("--only-cluster", action="store_true", help="only the three-node clusters")
    ap.add_argument("--baseline", metavar="BIN",
                    help="also an inline naam-server of this binary (another build), in the same "
                         "rotation, for an A/B of two builds; no udp target, no clusters")
    ap.add_argument("--scale", type=int, default=1, metavar="F",
                    help="F times the requests per test (longer runs, steadier rates)")
    ap.add_argument("--points", metavar="P:C,...",
                    help="only these (-P, -c) points, e.g. 16:50,1:8")
    args = ap.parse_args()
    if args.scale < 1:
        sys.exit(f"--scale {args.scale}: at least 1")
    for p in REQUESTS:
        REQUESTS[p] *= args.scale
    points = POINTS
    if args.points:
        try:
            points = [tuple(int(x) for x in pc.split(":")) for pc in args.points.split(",")]
        except ValueError:
            sys.exit(f"--points {args.points!r}: write P:C pairs separated by commas")
        if any(len(pc) != 2 or pc[0] not in REQUESTS or pc[1] < 1 for pc in points):
            sys.exit(f"--points {args.points!r}: -P is 1 or 16, -c at least 1")
    if args.baseline:
        args.no_cluster = True
        baseline = os.path.abspath(args.baseline)
        if not os.access(baseline, os.X_OK):
            sys.exit(f"--baseline {baseline}: not an executable")
    binary = os.path.abspath(os.path.join(args.bin, "naam-server"))
    for tool in ("redis-server", "redis-cli", "redis-benchmark"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed (bash scripts/setup.sh)")
    if not os.access(binary, os.X_OK):
        sys.exit(f"no {binary}: cargo build --release -p naam-server")
    work = tempfile.mkdtemp(prefix="resp-vs-redis-")
    started = []
    try:
        targets = {"naam (inline)": Naam(binary, work, "inline"), "redis-server": Redis(work)}
        if args.baseline:
            targets["baseline (inline)"] = Naam(baseline, work, "inline")
        else:
            targets["naam (udp)"] = Naam(binary, work, "udp")
        started += targets.values()
        # One unmeasured pass each: a fresh server's first writes fault its regions' pages in
        # (and its handlers' JIT code is built), which showed as 21 µs of server CPU a SET.
        for t in targets.values():
            if not args.only_cluster:
                benchmark(t.resp, t.auth(), 16, 8)
        results = {}  # (target, p, c, test) -> [(rps, p99 ms, server CPU µs per request)]
        names = list(targets)
        for rnd in range(0 if args.only_cluster else args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for p, c in points:
                for name in order:
                    t = targets[name]
                    for test, v in benchmark(t.resp, t.auth(), p, c, pid=t.proc.pid).items():
                        results.setdefault((name, p, c, test), []).append(v)
            print(f"round {rnd + 1} of {args.rounds} done", file=sys.stderr)
        cluster_results = {}
        if not args.no_cluster:
            for t in targets.values():
                t.stop()
            started.clear()
            ports = [(free_port(), free_port()) for _ in range(3)]
            text = cluster_file(ports)
            first = Naam(binary, work, "inline", cluster=text, ports=ports[0])
            naam_nodes = [first] + [
                Naam(binary, work, "inline", cluster=text, ports=pp, key=f"{first.dir}/mica.key")
                for pp in ports[1:]
            ]
            started += naam_nodes
            redis_nodes = [Redis(work, cluster=True) for _ in range(3)]
            started += redis_nodes
            subprocess.run(["redis-cli", "--cluster", "create",
                            *[f"127.0.0.1:{r.resp}" for r in redis_nodes],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            time.sleep(2)
            clusters = {"naam x3 (inline)": naam_nodes[0], "redis x3": redis_nodes[0]}
            for rnd in range(args.rounds):
                order = list(clusters) if rnd % 2 == 0 else list(clusters)[::-1]
                for p, c in [(1, 50), (16, 50)]:
                    for name in order:
                        t = clusters[name]
                        for test, v in benchmark(t.resp, t.auth(), p, c, cluster=True).items():
                            cluster_results.setdefault((name, p, c, test), []).append(v)
    finally:
        for t in started:
            try:
                t.stop()
            except Exception as e:  # keep stopping the others
                print(f"stopping: {e}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)

    def med(vals, i):
        return statistics.median(v[i] for v in vals)

    print(f"{args.rounds} alternating rounds; median of the rounds; 1024-byte values, "
          f"-r 100000 keys; requests per test: {REQUESTS}, x{CLUSTER_FACTOR} for clusters\n")
    if results:
        # The inline path against redis-server and a second naam target: the UDP path, or
        # with --baseline the other build's inline path (and the ratio of the two builds).
        if args.baseline:
            print(f"naam: {binary}; baseline: {baseline}\n")
            other, label, short, mine = "baseline (inline)", "baseline inline", "baseline", "naam"
        else:
            other, label, short, mine = "naam (udp)", "naam udp", "udp", "inline"
        builds = " naam / baseline |" if args.baseline else ""
        print(f"| test | -P | -c | redis-server ops/s | {label} ops/s (ratio) "
              f"| naam inline ops/s (ratio) |{builds} p99 ms redis / {short} / {mine} "
              f"| server CPU µs/request redis / {short} / {mine} |")
        print("|---" * (9 if args.baseline else 8) + "|")
        for test in ("SET", "GET"):
            for p, c in points:
                r = results[("redis-server", p, c, test)]
                o = results[(other, p, c, test)]
                i = results[("naam (inline)", p, c, test)]
                ratio = f" {med(i, 0) / med(o, 0):.2f} |" if args.baseline else ""
                print(f"| {test} | {p} | {c} | {med(r, 0):,.0f} "
                      f"| {med(o, 0):,.0f} ({med(o, 0) / med(r, 0):.2f}) "
                      f"| {med(i, 0):,.0f} ({med(i, 0) / med(r, 0):.2f}) |{ratio} "
                      f"{med(r, 1):.2f} / {med(o, 1):.2f} / {med(i, 1):.2f} "
                      f"| {med(r, 2):.2f} / {med(o, 2):.2f} / {med(i, 2):.2f} |")
    if cluster_results:
        print("\nThree-node clusters, `redis-benchmark --cluster`:\n")
        print("| test | -P | -c | redis x3 ops/s | naam x3 inline ops/s (ratio) | p99 ms redis / naam |")
        print("|---|---|---|---|---|---|")
        for test in ("SET", "GET"):
            for p, c in [(1, 50), (16, 50)]:
                r = cluster_results[("redis x3", p, c, test)]
                n = cluster_results[("naam x3 (inline)", p, c, test)]
                print(f"| {test} | {p} | {c} | {med(r, 0):,.0f} | {med(n, 0):,.0f} ({med(n, 0) / med(r, 0):.2f}) "
                      f"| {med(r, 1):.2f} / {med(n, 1):.2f} |")


if __name__ == "__main__":
    main()
