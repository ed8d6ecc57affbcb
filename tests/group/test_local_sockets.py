"""Ranks on one host talk over abstract Unix sockets (TCP otherwise); awaited waits keep the
group's descriptor registered with the event loop without spinning on it."""

import asyncio
import os
import socket
import time

import pytest

import ctrlcomm
from ctrlcomm import _wire as w
from ctrlcomm.testing import free_port, run_group, run_ranks


def families(rank, size, port, mode):
    os.environ["CTRLCOMM_LOCAL_SOCKETS"] = mode
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="fam", timeout=30,
                               transport="tcp") as g:  # (sockets: "shm" sends through rings)
        got = g.all_gather(rank * 10)
        g.all_to_all([rank] * size)
        fams = sorted({c.sock.family.name for c in g._core.ep.out.values()})
        g.barrier()
        return got, fams


@pytest.mark.parametrize("mode", ["1", "0", "auto"])
@pytest.mark.parametrize("size", [2, 3])
def test_same_host_peers_use_unix_sockets_when_ranks_outnumber_cpus(mode, size):
    from ctrlcomm.transport._net import _cpus

    res = run_ranks(families, size, free_port(), mode)
    local = mode == "1" or (mode == "auto" and size > _cpus())
    for got, fams in res:
        assert got == [10 * r for r in range(size)]
        assert fams == (["AF_UNIX"] if local else ["AF_INET"])


def spare_cpu(rank, size, port):
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="spare", timeout=30) as g:
        g.barrier()
        return g._core.ep.spare_cpu, g._core.ep.usock is not None


@pytest.mark.parametrize("size", [2, 3])
def test_awaited_waits_look_twice_only_where_each_rank_has_a_cpu(size):
    from ctrlcomm.transport._net import _cpus

    for spare, knows_its_host in run_ranks(spare_cpu, size, free_port()):
        # (which ranks share the host is known from the Unix addresses they publish)
        assert spare == (knows_its_host and size <= _cpus())


def test_local_socket_rule():
    from ctrlcomm.transport._net import use_local_sockets

    assert not use_local_sockets(2, 2) and not use_local_sockets(8, 64)
    assert use_local_sockets(3, 2) and use_local_sockets(8, 2)


def foreign_user(rank, size, port):
    os.environ["CTRLCOMM_LOCAL_SOCKETS"] = "1"
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="fu", timeout=30) as g:
        return _foreign_user(g)


def _foreign_user(g):
    """Rank 0 sends, as user 'nobody', a frame to rank 1's Unix socket: it must be refused."""
    g.barrier()
    if g.rank == 0:
        name = g._core.ep.local_peers[1]
        frames = w.encode(w.Message(w.P2P, 0, g._core.group_id, 1, 0, 0, w.NO_ROOT, w.PICKLE,
                                    b"\x80\x05K\x07."))
        pid = os.fork()
        if pid == 0:  # the child: drop to another user, then connect
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect("\0" + name)
                    s.sendall(w.stream_prefix(frames) + b"".join(frames))
                    time.sleep(0.3)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    g.barrier()
    out = None
    if g.rank == 1:
        try:
            out = g.recv(0, timeout=0.3)
        except ctrlcomm.CollectiveTimeoutError:
            out = "nothing"
    g.barrier()
    if g.rank == 0:
        g.send("real", dst=1)
    got = g.recv(0) if g.rank == 1 else None
    return out, got, g.stats()["dropped"], g.all_reduce(1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_unix_socket_refuses_other_users():
    res = run_ranks(foreign_user, 2, free_port())
    out, got, dropped, total = res[1]
    assert (out, got, total) == ("nothing", "real", 2)
    assert dropped.get("foreign_user") == 1


def idle_loop(g):
    """While rank 0's event loop sleeps, rank 1 sends: the loop must not spin on the ready
    descriptor; messages wait for the next awaited call; a second loop works too."""
    if g.rank == 1:
        time.sleep(0.3)  # so that rank 0 waits in the event loop
        g.barrier()
        for i in range(20):
            g.send(i, dst=0)
            time.sleep(0.04)
        g.barrier()
        g.barrier()
        return g.all_reduce(5)

    async def first():
        await g.aio.barrier()  # registers the descriptor with this loop
        c0 = time.process_time()
        await asyncio.sleep(1.2)  # rank 1 sends meanwhile
        cpu = time.process_time() - c0
        got = [await g.aio.recv(1) for _ in range(20)]
        await g.aio.barrier()
        return cpu, got

    cpu, got = asyncio.run(first())
    g.barrier()  # blocking, between two loops

    async def second():
        return await g.aio.all_reduce(5)

    return cpu, got, asyncio.run(second())


def test_awaited_waits_do_not_spin_while_the_loop_idles():
    (cpu, got, total), other = run_group(idle_loop, 2)
    assert got == list(range(20))
    assert total == other == 10
    assert cpu < 0.3, f"the event loop used {cpu:.2f} s of CPU while idle for 1.2 s"


def bogus_local_name(rank, size, port):
    os.environ["CTRLCOMM_LOCAL_SOCKETS"] = "1"
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="bogus", timeout=30) as g:
        if rank == 0:  # a Unix address nobody listens on: the connection falls back to TCP
            g._core.ep.local_peers[1] = "ctrlcomm-nobody-listens-here"
        got = g.all_gather(rank)
        fams = sorted({c.sock.family.name for c in g._core.ep.out.values()})
        g.barrier()
        return got, fams


def test_a_unix_connection_that_fails_falls_back_to_tcp():
    (got0, fams0), (got1, fams1) = run_ranks(bogus_local_name, 2, free_port())
    assert got0 == got1 == [0, 1]
    assert fams0 == ["AF_INET"] and fams1 == ["AF_UNIX"]


def other_users_host_id(q):
    from ctrlcomm.transport import _net as t

    t._host_id = None
    os.setgid(65534)
    os.setuid(65534)
    q.put(t.host_id())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_other_users_have_another_host_id():
    import multiprocessing as mp

    from ctrlcomm.transport._net import host_id

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=other_users_host_id, args=(q,))
    p.start()
    theirs = q.get(timeout=30)
    p.join(30)
    assert theirs and theirs != host_id()  # so ranks of two users talk over TCP


def streaming_peer(g):
    """Rank 1 streams messages rank 0 does not wait for: rank 0's awaited recv must still let
    its other coroutines run; then a close from another task ends a pending recv at once."""
    if g.rank == 1:
        end = time.monotonic() + 0.6
        n = 0
        chunk = b"x" * (256 * 1024)  # large: rank 0 always has more to read
        while time.monotonic() < end:
            g.send(chunk, dst=0, tag=5)
            n += 1
        g.send("done", dst=0, tag=9)
        g.barrier()
        time.sleep(1.5)  # alive while rank 0's pending recv is ended by its own close
        return n

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        got = await g.aio.recv(1, tag=9)
        t.cancel()
        await g.aio.barrier()

        async def closer():
            await asyncio.sleep(0.2)
            g.close()

        c = asyncio.ensure_future(closer())
        t0 = time.monotonic()
        try:
            await g.aio.recv(1, tag=7, timeout=20)
            err = None
        except ctrlcomm.GroupClosedError as e:
            err = str(e)
        await c
        return got, ticks, err, time.monotonic() - t0

    return asyncio.run(main())


def test_awaited_recv_lets_other_tasks_run_and_close_ends_it():
    (got, ticks, err, waited), sent = run_group(streaming_peer, 2)
    assert got == "done" and sent > 10
    assert ticks >= 8, f"the ticker ran {ticks} times while rank 0 read the stream"
    assert err is not None and "closed" in err and waited < 5


def count_awaited_waits(g):
    """Awaited all_reduce calls of a star (world 3): how many times a non-root's wait
    returned per call. It needs one reply per call, so one wait; a reader callback left
    queued by the event loop (the socket still unread when the loop looked again) would wake
    the next call's wait with nothing to read, nearly once per call."""
    ep = g._core.ep
    ep.spare_cpu = False  # no turn before sleeping (taken where each rank has a CPU): the
    # stale callback would then find no waiter and only unregister, hiding what is tested
    woke = 0
    inner = ep.wait_async

    async def wait_async(timeout):
        nonlocal woke
        await inner(timeout)
        woke += 1

    async def main():
        for i in range(50):
            await g.aio.all_reduce(i)
        ep.wait_async = wait_async
        for i in range(300):
            assert await g.aio.all_reduce([i, g.rank], op="max") == [i, 2]
        return woke

    return asyncio.run(main())


def test_awaited_waits_of_a_star_wake_once_per_reply():
    woke = run_group(count_awaited_waits, 3)
    for rank in (1, 2):  # the non-roots
        assert woke[rank] <= 1.2 * 300, f"rank {rank}: {woke[rank]} waits for 300 replies"


def closed_during_the_turn(g):
    """A group closed by another task while an awaited wait gives the loop its turn (world
    2 on one host: each rank has a CPU where this machine has two): the call says so."""

    async def main():
        if g.rank == 1:
            await asyncio.sleep(0.5)  # stays up (silent) while rank 0 closes
            return None
        asyncio.get_running_loop().call_soon(g.close)  # runs during the recv's first wait
        try:
            await g.aio.recv(1, tag=9, timeout=10)
        except ctrlcomm.GroupClosedError as e:
            return str(e), g._core.ep.spare_cpu, g._core.ep.usock is not None
        return "received", None, None

    return asyncio.run(main())


def test_group_closed_while_an_awaited_wait_gives_the_loop_a_turn():
    from ctrlcomm.transport._net import _cpus

    (err, spare, knows_its_host), _ = run_group(closed_during_the_turn, 2)
    assert "closed" in err, err
    # the turn was taken where the machine has the CPUs
    assert spare == (knows_its_host and _cpus() >= 2)


def error_while_reading_in_the_callback(g):
    """An exception met while an awaited wait's reader callback reads (here: a failing sink)
    is the call's error and the group's recorded cause, not a cancellation."""

    async def main():
        await g.aio.all_reduce(0, timeout=5)  # connections made: what comes next is data
        if g.rank == 1:
            await asyncio.sleep(0.3)  # rank 0 waits in the event loop meanwhile
            # first a message the call does not expect: the callback hands it to the sink
            # (the expected one alone would be read the short way, without the sink)
            await g.aio.send("p2p", dst=0)
            await g.aio.all_reduce(1, timeout=5)
            return None
        ep = g._core.ep
        ep.spare_cpu = False  # straight to the loop: the reader callback reads

        def failing_sink(m):
            raise RuntimeError("sink failed")

        ep.sink = g._core._sink = failing_sink
        try:
            await g.aio.all_reduce(1, timeout=5)
        except RuntimeError as e:
            first = str(e)
        try:
            await g.aio.barrier(timeout=5)
        except ctrlcomm.GroupBrokenError as e:
            then = str(e)
        return first, then

    return asyncio.run(main())


def test_an_error_in_the_reader_callback_is_the_calls_error():
    (first, then), _ = run_group(error_while_reading_in_the_callback, 2)
    assert first == "sink failed"
    assert "sink failed" in then and "cancelled" not in then, then
