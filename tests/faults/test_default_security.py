"""Groups made with the defaults (no auth_key), as every vLLM and Megatron user's are,
against a stranger: one who reaches every port (store and ranks) but did not join, and one
who reads the network after formation. No rank unpickles anything of theirs, no result
changes (their frames are dropped and counted), and the store they flood stays bounded and
serving. Real processes over real sockets, on loopback."""

import os
import pathlib
import pickle
import resource
import socket
import struct
import time

import pytest

import ctrlcomm
from ctrlcomm import _wire as w
from ctrlcomm.testing import free_port, run_ranks

FORMATION = "ctrlcomm/default/ctrlcomm:formation/"


class Planted:
    """A pickle that, loaded, creates the file ``path``: code of the stranger's, run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def stranger_frames(gid, src, path, key=None, dst=-1):
    """What a stranger sends a rank as rank ``src`` of group ``gid``: a hello, then
    collective messages of the first seqs and rounds and point-to-point ones, each a pickle
    that plants ``path``; with ``key`` (a guess) MACed."""
    payload = pickle.dumps(Planted(path))
    out = [w.encode(w.Message(w.HELLO, src, gid, 0, 0, 0, w.NO_ROOT), key, dst)]
    for seq in range(40):
        for rnd in range(3):
            for op in range(1, len(w.OPS) + 1):
                out.append(w.encode(w.Message(w.COLL, src, gid, seq, rnd, op, 0, w.PICKLE,
                                              payload), key, dst))
    for n in range(1, 20):
        out.append(w.encode(w.Message(w.P2P, src, gid, n, 0, 0, w.NO_ROOT, w.PICKLE, payload),
                            key, dst))
    return out


def send_frames(address, frames, transport):
    """Send ``frames`` (a list of messages) to a rank's endpoint ``address``."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    if transport == "tcp":
        data = b"".join(w.stream_prefix(f) + b"".join(f) for f in frames)
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as s:
                s.sendall(data)
                time.sleep(0.2)
        except OSError:  # (a rank that dropped the connection, as it may)
            pass
        return
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(address)
    for f in frames:
        s.send_multipart(f)
    s.close()
    ctx.term()


def store_client(port):
    return ctrlcomm.StoreClient("127.0.0.1", port, timeout=30)


def ranks_at_work(g, steps=60):
    """What the ranks do meanwhile: all_reduces whose results are known, and a broadcast
    from rank 1; then their counters."""
    bad = []
    for i in range(steps):
        got = g.all_reduce(g.rank + i, timeout=30)
        if got != sum(r + i for r in range(g.world_size)):
            bad.append((i, got))
        if g.broadcast(("cfg", i) if g.rank == 1 else None, src=1, timeout=30) != ("cfg", i):
            bad.append((i, "broadcast"))
        time.sleep(0.05)
    g.barrier(timeout=30)
    return bad, g.stats()["dropped"]


# ------------------------------------------------------------------ the store race


def store_race(rank, size, port, transport, mark):
    """Ranks 0-2 form a group and work; rank 3, a stranger, races them through the store
    for the address table (as one who knows the store's address and the default name):
    asking for it, and then joining as a rank the group does not have to get it, and
    sending each rank frames that would plant ``mark``."""
    if rank < 3:
        if rank:
            time.sleep(1.5)  # (the table is published once they come: the stranger waits)
        with ctrlcomm.Group.create("127.0.0.1", port, rank, 3, timeout=30,
                                   transport=transport) as g:
            return ranks_at_work(g)
    seen = {}
    c = None
    deadline = time.monotonic() + 20
    while c is None and time.monotonic() < deadline:
        try:
            c = store_client(port)
            c.ping(timeout=1)
        except ctrlcomm.StoreError:
            c = None
            time.sleep(0.01)
    try:
        c.get(FORMATION + "table", timeout=20)
        seen["table, not joined"] = "given"
    except ctrlcomm.StoreError as e:
        seen["table, not joined"] = str(e)
    seen["listed"] = [k for k in c.list_keys() if "formation" in k]
    # joined, as a rank the group does not have: the table (addresses and nonce) is given
    # to those who joined; the secret is each rank's own
    ok, _ = c.set_if_absent(FORMATION + "rank/7", "tcp://127.0.0.1:9 9")
    table = c.get(FORMATION + "table", timeout=20).decode().split("\n")
    seen["secrets"] = []
    for r in (1, 2, 7):
        try:
            c.get(FORMATION + f"secret/{r}", wait=False, timeout=5)
            seen["secrets"].append((r, "given"))
        except (ctrlcomm.StoreError, KeyError) as e:
            seen["secrets"].append((r, type(e).__name__))
    nonce, addrs = table[0], [line.split(" ")[0] for line in table[1:]]
    import hashlib

    gid = int.from_bytes(hashlib.blake2b(f"default\0{nonce}".encode(), digest_size=8).digest(),
                         "little")
    for r, a in enumerate(addrs):
        for key in (None, os.urandom(32)):  # (no MAC; a MAC with a key of its own)
            send_frames(a, stranger_frames(gid, (r + 1) % 3, mark, key, r), transport)
    c.close()
    return ok, seen


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_a_stranger_racing_through_the_store_runs_nothing_and_changes_nothing(transport,
                                                                             tmp_path):
    mark = str(tmp_path / "planted")
    res = run_ranks(store_race, 4, free_port(), transport, mark, timeout=110)
    joined, seen = res[3]
    assert "has not joined" in seen["table, not joined"], seen
    assert seen["listed"] == [] and joined, seen
    assert seen["secrets"] == [(1, "StoreError"), (2, "StoreError"), (7, "StoreKeyError")], seen
    assert not os.path.exists(mark)
    for r in range(3):
        bad, dropped = res[r]
        assert bad == [], (r, bad)
        assert sum(dropped.values()) > 0, (r, dropped)  # (dropped, and counted)


# ------------------------------------------------------- what one reading the network sees


def sniff_udp(ports, until):
    """The first UDP datagram to one of ``ports`` seen on the loopback (a raw socket: the
    heartbeats a sniffer reads), or None."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    s.bind(("lo", 0))
    s.settimeout(0.5)
    try:
        while time.monotonic() < until:
            try:
                pkt = s.recv(65535)
            except TimeoutError:
                continue
            ip = pkt[14:]
            if len(ip) < 28 or ip[0] >> 4 != 4 or ip[9] != 17:
                continue
            ihl = (ip[0] & 15) * 4
            dport = struct.unpack_from("!H", ip, ihl + 2)[0]
            if dport in ports:
                return ip[ihl + 8:]
    finally:
        s.close()
    return None


def sniffed(rank, size, port, transport, mark, where):
    """Ranks 0-2 form a group, publish their addresses and heartbeat ports (what a sniffer
    sees on the wire) in ``where``, and work; rank 3 reads a heartbeat off the loopback,
    takes its group id, and sends each rank frames of that group: forged (no MAC, or one
    of its own), a heartbeat replayed, and heartbeats forged for a rank."""
    if rank < 3:
        with ctrlcomm.Group.create("127.0.0.1", port, rank, 3, timeout=30,
                                   transport=transport, heartbeat_interval=0.1) as g:
            with open(os.path.join(where, str(rank)), "w") as f:
                f.write(f"{g._core.ep.address} {g._core.hb.port}")
            return ranks_at_work(g)
    until = time.monotonic() + 30
    while len(os.listdir(where)) < 3 and time.monotonic() < until:
        time.sleep(0.05)
    peers = [pathlib.Path(where, str(r)).read_text().split() for r in range(3)]
    beat = sniff_udp({int(p[1]) for p in peers}, until)
    gid, src, _ = struct.unpack_from("<QIQ", beat)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        for r, (address, hb) in enumerate(peers):
            send_frames(address, stranger_frames(gid, (r + 1) % 3, mark, None, r), transport)
            send_frames(address, stranger_frames(gid, (r + 1) % 3, mark, os.urandom(32), r),
                        transport)
            for n in range(10**6, 10**6 + 50):  # (far ahead, as a forged liveness would be)
                u.sendto(struct.pack("<QIQ", gid, (r + 1) % 3, n) + bytes(16),
                         ("127.0.0.1", int(hb)))
            u.sendto(beat, ("127.0.0.1", int(hb)))  # (replayed: to another rank, or late)
    return gid, src


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="reading the loopback's packets needs root")
@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_one_who_read_a_heartbeats_group_id_runs_nothing_and_changes_nothing(transport,
                                                                            tmp_path):
    mark = str(tmp_path / "planted")
    where = tmp_path / "addresses"
    where.mkdir()
    res = run_ranks(sniffed, 4, free_port(), transport, mark, str(where), timeout=110)
    assert not os.path.exists(mark)
    for r in range(3):
        bad, dropped = res[r]
        assert bad == [], (r, bad)
        assert dropped.get("heartbeat_unauthenticated", 0) >= 50, (r, dropped)


# ------------------------------------------------------- a pair not connected yet (TCP)


def not_yet_connected(rank, size, port, mark, where):
    """Rank 2 sends rank 1 its first point-to-point message 3 s after formation (over
    TCP, no connection from 2 to 1 is made before); meanwhile a stranger who knows the
    group id connects to rank 1 as rank 2 and sends it messages. Rank 1 must get rank 2's."""
    if rank < 3:
        with ctrlcomm.Group.create("127.0.0.1", port, rank, 3, timeout=30) as g:
            if rank == 1:
                with open(where, "w") as f:
                    f.write(f"{g._core.ep.address} {g._core.group_id}")
                got = [g.recv(src=2, timeout=20) for _ in range(2)]
                out = got, g.stats()["dropped"]
            elif rank == 2:
                time.sleep(3)
                g.send("genuine", dst=1)
                g.send(("second", 2), dst=1)
                out = None
            else:
                out = None
            g.barrier(timeout=30)
            return out
    until = time.monotonic() + 30
    while not os.path.exists(where) and time.monotonic() < until:
        time.sleep(0.05)
    time.sleep(0.3)
    address, gid = pathlib.Path(where).read_text().split()
    frames = [f for f in stranger_frames(int(gid), 2, mark, None, 1)
              if f[0][3] in (w.HELLO, w.P2P)]
    send_frames(address, frames, "tcp")
    send_frames(address, [f for f in stranger_frames(int(gid), 2, mark, os.urandom(32), 1)
                          if f[0][3] in (w.HELLO, w.P2P)], "tcp")
    return None


def test_a_stranger_speaking_for_a_rank_not_connected_yet_is_not_heard(tmp_path):
    mark = str(tmp_path / "planted")
    res = run_ranks(not_yet_connected, 4, free_port(), mark, str(tmp_path / "rank1"),
                    timeout=90)
    got, dropped = res[1]
    assert got == ["genuine", ("second", 2)], got
    assert not os.path.exists(mark)
    assert dropped.get("malformed", 0) > 0, dropped


# ------------------------------------------------------------------ the store flood


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def flooded(rank, size, port, where, n_conns, limit):
    """Rank 0 hosts the store of a group of one (the defaults: no key; at most ``limit``
    connections) and measures itself while rank 1, a stranger, floods the store: values
    of 16 MiB, a request of millions of empty frames, ``n_conns`` idle connections. Then a
    client of the group's uses it, and a second group forms through it."""
    if rank == 0:
        g = ctrlcomm.Group.create("127.0.0.1", port, 0, 1, timeout=30,
                                  store_limits=ctrlcomm.StoreLimits(max_connections=limit))
        g.store.set("ready", "1")
        before = rss()
        open(where, "w").close()
        g.store.wait(["flooded"], timeout=100)
        grown = rss() - before
        fds = len(os.listdir("/proc/self/fd"))
        g.store.set("mine", "after")
        with ctrlcomm.Group.create("127.0.0.1", port, 0, 1, name="next", timeout=30) as h:
            formed = h.all_reduce(5)
        out = grown, fds, g.store.get("mine"), formed
        g.close()
        return out
    until = time.monotonic() + 30
    while not os.path.exists(where) and time.monotonic() < until:
        time.sleep(0.05)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n_conns + 1024), hard))
    c = store_client(port)
    refused = []
    for i in range(64):  # 64 values of 16 MiB
        try:
            c.set(f"big/{i}", bytes(16 << 20), timeout=30)
        except ctrlcomm.StoreError as e:
            refused.append(str(e))
    # one request of 4 M empty frames
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(w.store_hello(os.urandom(16)))
            s.sendall(struct.pack("<2sI", b"CQ", 4_000_000) + bytes(4 * 65536))
            s.sendall(bytes(8 << 20))
        except OSError:
            refused.append("4M frames: connection closed")
    idle = []
    for _ in range(n_conns):
        try:
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    time.sleep(1)
    c.close()
    c = store_client(port)  # (its connection, one of the least recently active, was closed)
    c.set("ctrlcomm/default/flooded", "1")  # (rank 0's: its group's namespace)
    for s in idle:
        s.close()
    c.close()
    return refused, len(idle)


@pytest.mark.slow
def test_a_flooded_store_stays_bounded_and_serving(tmp_path):
    res = run_ranks(flooded, 2, free_port(), str(tmp_path / "ready"), 3000, 256, timeout=110)
    (grown, fds, mine, formed), (refused, opened) = res
    assert len([r for r in refused if "max_total_bytes" in r]) >= 62, refused
    assert opened == 3000
    assert grown < 64 << 20, grown / (1 << 20)
    assert fds < 256 + 64, fds
    assert mine == b"after" and formed == 5


def test_a_store_without_a_key_on_a_reachable_address_says_what_it_protects_once():
    import subprocess
    import sys

    code = ("import logging, ctrlcomm\n"
            "logging.basicConfig()\n"
            "a = ctrlcomm.StoreServer('127.0.0.1', 0); a.close()\n"
            "b = ctrlcomm.StoreServer('0.0.0.0', 0); b.close()\n"
            "c = ctrlcomm.StoreServer('0.0.0.0', 0); c.close()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("without an auth_key") == 1, p.stderr
    assert "What the default protects" in p.stderr and "What it does not" in p.stderr
