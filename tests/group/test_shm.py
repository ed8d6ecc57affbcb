"""The shared-memory transport (``transport="shm"``, the default): ranks of one host, user and
IPC namespace send to each other through rings in anonymous memory files handed over on a
Unix socket; every other test of a group with no transport given runs over it too."""

import os
import signal
import socket
import time

import pytest

import ctrlcomm
from ctrlcomm.rendezvous._server import StoreServer
from ctrlcomm.testing import free_port, run_ranks
from ctrlcomm.transport._shm import HANDOVER, MAX_RING, Ring


def ring_peers(g):
    return sorted(r for r, c in g._core.ep.out.items() if c.ring is not None)


def ring_files():
    """This process's ring memory files: {fd: permission bits}, and its mappings of them."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:ctrlcomm-ring"):
            fds[int(name)] = os.stat(f"/proc/self/fd/{name}").st_mode & 0o777
    with open("/proc/self/maps") as f:
        maps = sum("memfd:ctrlcomm-ring" in line for line in f)
    return fds, maps


def everything(rank, size, port, transport):
    kw = {} if transport is None else {"transport": transport}
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="shm", timeout=30,
                               **kw) as g:
        out = {"gather": g.all_gather(rank), "sum": g.all_reduce(rank),
               "a2a": g.all_to_all([(rank, d) for d in range(size)]),
               "bcast": len(g.broadcast(b"x" * (3 << 20) if rank == 0 else None, src=0))}
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        g.send({"from": rank}, dst=nxt, tag=5)
        out["p2p"] = g.recv(src=prv, tag=5)
        out["rings"] = ring_peers(g)
        out["kind"] = g.stats()["transport"]
        out["files"] = ring_files()
        g.barrier()
    out["after"] = ring_files()
    return out


def shm_names():
    """Named shared memory of ctrlcomm's (other processes' come and go meanwhile)."""
    try:
        return {n for n in os.listdir("/dev/shm") if "ctrlcomm" in n}
    except OSError:
        return set()


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_of_one_host_talk_through_rings_that_leave_nothing_behind(size):
    before = shm_names()
    res = run_ranks(everything, size, free_port(), None)
    for rank, out in enumerate(res):
        assert out["gather"] == list(range(size))
        assert out["sum"] == sum(range(size))
        assert out["a2a"] == [(s, rank) for s in range(size)]
        assert out["bcast"] == 3 << 20
        assert out["p2p"] == {"from": (rank - 1) % size}
        assert out["kind"] == "shm"
        assert out["rings"] == sorted(set(range(size)) - {rank})
        fds, maps = out["files"]
        assert fds and set(fds.values()) == {0o600}, fds  # this user only
        assert maps >= len(out["rings"])  # (its own rings and those handed to it)
        assert out["after"] == ({}, 0)
    assert shm_names() <= before  # (no named segment either)


def without_rings(rank, size, port):
    from ctrlcomm.transport import _shm

    _shm.AVAILABLE = False  # (as on a machine whose stores may be seen out of order: ARM)
    return everything(rank, size, port, None)


def test_where_rings_are_not_safe_shm_sends_over_unix_sockets():
    res = run_ranks(without_rings, 2, free_port())
    for rank, out in enumerate(res):
        assert out["gather"] == [0, 1] and out["p2p"] == {"from": 1 - rank}
        assert out["rings"] == [] and out["files"] == ({}, 0)


def test_transport_tcp_and_the_variable_send_on_sockets(monkeypatch):
    res = run_ranks(everything, 2, free_port(), "tcp")
    assert [(o["rings"], o["kind"], o["files"]) for o in res] == [([], "tcp", ({}, 0))] * 2
    monkeypatch.setenv("CTRLCOMM_TRANSPORT", "tcp")
    res = run_ranks(everything, 2, free_port(), None)
    assert [(o["rings"], o["kind"]) for o in res] == [([], "tcp")] * 2


def stream(rank, size, port, n, seed):
    """Messages of sizes around the ring's, both ways at once: what comes is what was sent."""
    import hashlib
    import random

    rnd = random.Random(seed + rank)
    sizes = [rnd.choice([1, 100, 4095, 65536, 300_000, 1 << 20, 3 << 20]) for _ in range(n)]
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="st", timeout=60) as g:
        sent = hashlib.sha256()
        peer = 1 - rank
        for i, k in enumerate(sizes):
            data = rnd.randbytes(k)
            sent.update(data)
            g.send(data, dst=peer, tag=i % 3)
        got = hashlib.sha256()
        for i in range(n):
            got.update(g.recv(src=peer, tag=i % 3))
        g.barrier()
        return sent.hexdigest(), got.hexdigest(), ring_peers(g)


def test_messages_larger_and_smaller_than_the_ring_come_whole_and_in_order():
    (s0, g0, r0), (s1, g1, r1) = run_ranks(stream, 2, free_port(), 60, 7, timeout=120)
    assert (g0, g1) == (s1, s0)
    assert (r0, r1) == ([1], [0])


def cycles(rank, size, port, n):
    counts = []
    for i in range(n):
        with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name=f"cy{i}", timeout=30,
                                   host_store=False) as g:
            g.barrier()
            assert ring_peers(g) == [1 - rank]
        if i % 50 == 0 or i == n - 1:
            counts.append((ring_files(), len(os.listdir("/proc/self/fd"))))
    return counts


def test_a_thousand_groups_made_and_closed_leave_no_ring_and_no_descriptor():
    with StoreServer("127.0.0.1", 0) as server:
        res = run_ranks(cycles, 2, server.port, 1000, timeout=600)
    for counts in res:
        assert all(files == ({}, 0) for files, _ in counts)
        fds = [n for _, n in counts]
        assert max(fds) - min(fds) <= 2, fds  # (no descriptor kept per group)


def killed(rank, size, port):
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="kill", timeout=30) as g:
        g.barrier()
        if rank == size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.monotonic()
        try:
            while True:
                g.barrier(timeout=20)
        except ctrlcomm.PeerLostError as e:
            err = (type(e).__name__, e.ranks, time.monotonic() - t)
        mapped = ring_files()[1]
    return err, mapped, ring_files()


def test_a_rank_killed_is_named_and_leaves_no_ring_once_the_others_close():
    res = run_ranks(killed, 3, free_port(), may_die=(2,))
    for out in res[:2]:
        (kind, ranks, _), mapped, after = out
        assert kind == "PeerLostError" and ranks == [2], out
        assert mapped > 0  # (the rings of the two survivors, still open)
        assert after == ({}, 0)


def spin_of(rank, size, port, kw, cpus):
    if cpus:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cpus]))
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="spin", timeout=30,
                               **kw) as g:
        g.barrier()
        return g._core.ep.spin_max, g._core.ep.spin


@pytest.mark.parametrize(("kw", "env", "cpus", "want"), [
    ({}, None, 0, 50e-6),
    ({"spin_us": 0}, None, 0, 0.0),
    ({"spin_us": 7}, "90", 0, 7e-6),
    ({}, "12.5", 0, 12.5e-6),
    ({}, None, 1, 0.0),  # two ranks, one CPU: no spin
])
def test_the_spin_budget_is_an_option_and_off_where_ranks_outnumber_cpus(
        monkeypatch, kw, env, cpus, want):
    from ctrlcomm.transport._net import _cpus

    if _cpus() < 2:
        pytest.skip("needs two CPUs")
    if env is not None:
        monkeypatch.setenv("CTRLCOMM_SPIN_US", env)
    for spin_max, spin in run_ranks(spin_of, 2, free_port(), kw, cpus):
        assert spin == pytest.approx(want)
        assert spin_max == pytest.approx(kw.get("spin_us", float(env or 50)) / 1e6)


@pytest.mark.parametrize(("kw", "env", "match"), [
    ({"spin_us": -1}, None, "spin_us must be"),
    ({"spin_us": "5"}, None, "spin_us must be"),
    ({"spin_us": float("nan")}, None, "spin_us must be"),
    ({}, "fast", "CTRLCOMM_SPIN_US='fast'"),
])
def test_a_bad_spin_budget_is_refused_naming_it(monkeypatch, kw, env, match):
    if env is not None:
        monkeypatch.setenv("CTRLCOMM_SPIN_US", env)
    with pytest.raises(ctrlcomm.InvalidArgumentError, match=match):
        ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, timeout=5, **kw)


def stranger(rank, size, port, what):
    """Rank 1 hands rank 0 a bad ring on rank 0's own Unix socket, as another process of
    this user could: rank 0 drops that connection, counts it, and the group goes on."""
    import array

    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="bad", timeout=30) as g:
        g.barrier()
        if rank == 1:
            name = g._core.ep.local_peers[0]
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + name)
            r, wr = os.pipe()
            if what == "pipe":
                fds = [r, wr, wr]
            elif what in ("small", "unsealed"):
                mem = os.memfd_create("x")
                os.ftruncate(mem, 5000 if what == "small" else 4096 + (1 << 20))
                fds = [mem, wr, wr]
            else:  # four descriptors: more than a ring's
                fds = [r, wr, r, wr]
            s.sendmsg([HANDOVER], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            for fd in set(fds):
                os.close(fd)
        g.barrier()
        for _ in range(200):  # (rank 0 accepts it in one drain, reads it in a later one)
            if g.all_reduce(int("bad_handover" in g.stats()["dropped"])):
                break
            time.sleep(0.01)
        got = g.all_gather(rank)
        dropped = g.stats()["dropped"]
        if rank == 1:
            s.close()
        g.barrier()
        return got, dropped


@pytest.mark.parametrize("what", ["pipe", "small", "unsealed", "four"])
def test_a_bad_ring_handed_over_is_dropped_and_counted(what):
    (got0, dropped0), (got1, _) = run_ranks(stranger, 2, free_port(), what)
    assert got0 == got1 == [0, 1]
    assert dropped0.get("bad_handover", 0) == 1, dropped0


def test_a_ring_wraps_fills_and_refuses_impossible_counts():
    import random

    ring = Ring.create(64 * 1024)
    reader = Ring(os.dup(ring.memfd), os.dup(ring.data_fd), os.dup(ring.room_fd), writer=False)
    try:
        rnd = random.Random(3)
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        sent, got = bytearray(), bytearray()
        for _ in range(300):
            k = rnd.randrange(1, 100_000)
            data = rnd.randbytes(k)
            try:
                n = ring.sendmsg([data[:k // 2], memoryview(data)[k // 2:]])
            except BlockingIOError:
                n = 0
            sent += data[:n]
            assert 0 <= n <= k
            while rnd.random() < 0.7:
                try:
                    m = reader.recv_into(view, rnd.randrange(1, 200_000))
                except BlockingIOError:
                    break
                got += buf[:m]
        while reader.ready():
            got += buf[:reader.recv_into(view, len(buf))]
        assert got == sent and len(sent) > 5 * 64 * 1024  # (wrapped around many times)
        with pytest.raises(BlockingIOError):
            reader.recv_into(view, 10)
        assert ring.sendmsg([bytes(64 * 1024 + 1)]) == 64 * 1024
        with pytest.raises(BlockingIOError):
            ring.send(b"x")
        # the writer, full, asked for room; the reader's next read says there is some
        ring.clear()
        reader.recv_into(view, 10)
        assert os.eventfd_read(ring.room_fd) == 1
        # counts another process could write, which cannot be: an error, never a bad read
        ring.ctl[0] = reader.ctl[8] + MAX_RING * 4
        with pytest.raises(OSError, match="write count"):
            reader.recv_into(view, 10)
        with pytest.raises(OSError, match="read count"):
            ring.send(b"x")
    finally:
        ring.close()
        reader.close()


def test_a_ring_whose_memory_is_not_a_rings_is_refused():
    mem = os.memfd_create("x")
    os.ftruncate(mem, 4096 + 3000)
    with pytest.raises(OSError, match="a shared ring of 7096 bytes"):
        Ring(mem, -1, -1, writer=False)
    os.close(mem)
