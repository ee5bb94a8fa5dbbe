"""redis-py (PyPI's `redis`) against naam-server's RESP front: apps/server/tests/resp.rs runs it.

    resp_clients.py single HOST PORT USER PASSWORD
    resp_clients.py cluster HOST PORT USER PASSWORD

Exits 0 when every check holds, and prints what it checked; an assertion's message otherwise.
"""

import sys

import redis
from redis.cluster import RedisCluster


def single(host, port, user, password):
    for protocol in (2, 3):
        r = redis.Redis(host=host, port=port, username=user, password=password, protocol=protocol)
        assert r.ping() is True
        assert r.echo(b"hi") == b"hi"
        assert r.set(f"py:{protocol}:a", b"1") is True
        assert r.get(f"py:{protocol}:a") == b"1"
        assert r.get(f"py:{protocol}:missing") is None
        assert r.mset({f"py:{protocol}:b": b"2", f"py:{protocol}:c": b"3"}) is True
        assert r.mget([f"py:{protocol}:a", f"py:{protocol}:x", f"py:{protocol}:c"]) == [b"1", None, b"3"]
        assert r.exists(f"py:{protocol}:a", f"py:{protocol}:b", f"py:{protocol}:x") == 2
        assert r.set(f"py:{protocol}:a", b"one", xx=True) is True
        assert r.set(f"py:{protocol}:nope", b"v", xx=True) is None
        assert r.delete(f"py:{protocol}:a", f"py:{protocol}:x") == 1
        assert r.client_setname("tester") is True
        assert r.client_getname() in ("tester", b"tester")
        assert r.incr(f"py:{protocol}:n") == 1
        assert r.incrby(f"py:{protocol}:n", 9) == 10
        assert r.decr(f"py:{protocol}:n") == 9
        # Increments pipelined together are all counted (each is one write batch).
        p = r.pipeline(transaction=False)
        for _ in range(100):
            p.incr(f"py:{protocol}:n")
        assert p.execute()[-1] == 109
        big = bytes(range(256)) * 4
        assert r.set(f"py:{protocol}:big", big) is True
        assert r.get(f"py:{protocol}:big") == big
        # A pipeline: many commands in one write, answers in order.
        p = r.pipeline(transaction=False)
        for i in range(200):
            p.set(f"py:{protocol}:p{i}", str(i))
            p.get(f"py:{protocol}:p{i}")
        out = p.execute()
        assert out[0::2] == [True] * 200
        assert out[1::2] == [str(i).encode() for i in range(200)]
        try:
            r.execute_command("FLUSHALL")
            raise AssertionError("FLUSHALL was answered")
        except redis.ResponseError as e:
            assert "unknown command" in str(e), e
        try:
            r.set(f"py:{protocol}:ttl", b"v", ex=10)
            raise AssertionError("SET EX was answered")
        except redis.ResponseError as e:
            assert "do not expire" in str(e), e
        info = r.info()
        assert info["redis_mode"] == "standalone", info
        r.close()
    bad = redis.Redis(host=host, port=port, username=user, password="00" * 32)
    try:
        bad.ping()
        raise AssertionError("a wrong password was accepted")
    except redis.AuthenticationError:
        pass
    print("single: RESP2 and RESP3, pipeline of 400, errors, AUTH refused: ok")


def cluster(host, port, user, password):
    rc = RedisCluster(host=host, port=port, username=user, password=password)
    nodes = rc.get_nodes()
    assert len(nodes) == 3, nodes
    for i in range(300):
        assert rc.set(f"cl:{i}", str(i)) is True
    for i in range(300):
        assert rc.get(f"cl:{i}") == str(i).encode()
    # Keys of one hash tag share a slot: a multi-key command on them is served.
    assert all(rc.mset_nonatomic({"{tag}a": b"1", "{tag}b": b"2"}))
    assert rc.mget_nonatomic(["{tag}a", "{tag}b", "cl:1", "cl:2"]) == [b"1", b"2", b"1", b"2"]
    # Every node served some of the keys: ask each node directly (no redirection).
    served = {}
    for n in nodes:
        direct = redis.Redis(host=n.host, port=n.port, username=user, password=password)
        served[n.port] = 0
        for i in range(300):
            try:
                if direct.get(f"cl:{i}") is not None:
                    served[n.port] += 1
            except redis.exceptions.MovedError:
                pass
        direct.close()
    assert all(v > 0 for v in served.values()), served
    assert sum(served.values()) == 300, served
    rc.close()
    print(f"cluster: 300 keys over 3 nodes {sorted(served.values())}, MOVED followed: ok")


if __name__ == "__main__":
    mode, host, port, user, password = sys.argv[1:6]
    {"single": single, "cluster": cluster}[mode](host, int(port), user, password)
