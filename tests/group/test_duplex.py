"""Full duplex: point-to-point calls of several tasks, and of several threads, run on one group
at once (a receiving task beside a sending one, as an engine writes them), with collectives
between them; receives of one (src, tag) take its messages in the order they were called.
Real ranks over real sockets, over every transport: TCP, TCP over Unix sockets (ranks of one
host, CTRLCOMM_LOCAL_SOCKETS=1) and ZeroMQ."""

import asyncio
import os
import threading
import time

import pytest

import ctrlcomm
from ctrlcomm.testing import run_group

TRANSPORTS = [
    pytest.param({"transport": "tcp"}, "0", id="tcp"),
    pytest.param({"transport": "tcp"}, "1", id="unix"),
    pytest.param({"transport": "zmq"}, "0", id="zmq"),
]


def _local(mode):
    os.environ["CTRLCOMM_LOCAL_SOCKETS"] = mode


def receiver_and_sender_tasks(g, n):
    """Each rank: per peer, one task sending ``n`` objects (tags 0 and 1 in turn) and one
    task per tag receiving them; then a barrier. What each receiver got, per (src, tag),
    in order."""

    async def main():
        peers = [r for r in range(g.size) if r != g.rank]
        got = {(p, tag): [] for p in peers for tag in (0, 1)}

        async def receive(src, tag):
            for _ in range(n // 2):
                got[(src, tag)].append(await g.aio.recv(src, tag=tag, timeout=60))

        async def send(dst):
            for i in range(n):
                await g.aio.send((g.rank, i), dst, tag=i % 2)

        await asyncio.gather(*[receive(p, tag) for p in peers for tag in (0, 1)],
                             *[send(p) for p in peers])
        await g.aio.barrier()
        return {k: v == [(k[0], i) for i in range(k[1], n, 2)] for k, v in got.items()}

    return asyncio.run(main())


@pytest.mark.parametrize(("kwargs", "local"), TRANSPORTS)
@pytest.mark.parametrize("world", [2, 4])
def test_a_receiving_task_and_a_sending_task_run_at_once(world, kwargs, local):
    """10,000 objects each way per pair of ranks, none lost or out of order per (src, tag)."""
    _local(local)
    try:
        res = run_group(receiver_and_sender_tasks, world, 10_000, timeout=300,
                        group_kwargs=kwargs)
    finally:
        os.environ.pop("CTRLCOMM_LOCAL_SOCKETS", None)
    for r, ok in enumerate(res):
        assert ok and all(ok.values()), (r, ok)


def threads_with_a_collective_between(g, n):
    """Rank 0 and 1: one thread receives ``n`` objects (blocking), another sends ``n``, and
    the main thread runs collectives meanwhile: 200 all_reduces, gathered at the end."""
    other = 1 - g.rank
    got, errors = [], []

    def receive():
        try:
            for _ in range(n):
                got.append(g.recv(other, tag=3, timeout=60))
        except Exception as e:  # (reported, not lost in the thread)
            errors.append(repr(e))

    def send():
        try:
            for i in range(n):
                g.send(i, other, tag=3)
        except Exception as e:
            errors.append(repr(e))

    ts = [threading.Thread(target=receive), threading.Thread(target=send)]
    for t in ts:
        t.start()
    sums = [g.all_reduce(i + g.rank, timeout=60) for i in range(200)]
    for t in ts:
        t.join(120)
    return errors, got == list(range(n)), sums == [2 * i + 1 for i in range(200)]


@pytest.mark.parametrize(("kwargs", "local"), TRANSPORTS)
def test_threads_send_and_receive_at_once_with_collectives_between(kwargs, local):
    _local(local)
    try:
        res = run_group(threads_with_a_collective_between, 2, 5000, timeout=300,
                        group_kwargs=kwargs)
    finally:
        os.environ.pop("CTRLCOMM_LOCAL_SOCKETS", None)
    assert res == [([], True, True)] * 2, res


def blocking_recv_beside_awaited_send(g):
    """A thread's blocking recv waits while the event loop's awaited sends and recvs go on;
    rank 1 answers the thread's recv only after the loop's exchange is done."""
    other = 1 - g.rank
    if g.rank == 1:
        async def echo():
            for _ in range(500):
                x = await g.aio.recv(0, timeout=30)
                await g.aio.send(x, 0)

        asyncio.run(echo())
        g.send("for the thread", 0, tag=9)
        g.barrier()
        return None
    box = {}
    t = threading.Thread(target=lambda: box.update(r=g.recv(other, tag=9, timeout=30)))
    t.start()
    time.sleep(0.1)  # (the thread waits first, and leads)

    async def main():
        out = []
        for i in range(500):
            await g.aio.send(i, other)
            out.append(await g.aio.recv(other, timeout=30))
        return out

    echoed = asyncio.run(main())
    t.join(30)
    g.barrier()
    return echoed == list(range(500)), box.get("r")


def test_a_threads_blocking_recv_and_the_loops_awaited_calls_mix():
    assert run_group(blocking_recv_beside_awaited_send, 2, timeout=120)[0] == (
        True, "for the thread")


def cancelled_among_several(g):
    """Rank 0 has five recvs waiting on rank 1: tags 1, 2 and 3, and two on tag 5 (called in
    that order). Tag 2's is cancelled, and another on tag 4 times out, while the rest wait;
    a collective runs meanwhile. Then rank 1 sends: each recv left gets its own, the two on
    tag 5 in the order they were called, and tag 2's object waits for the next recv of it."""
    if g.rank == 1:
        g.barrier()  # (rank 0's recvs wait, one cancelled, one timed out)
        assert g.all_reduce(1) == 2
        for tag, obj in ((5, "5a"), (3, "3"), (2, "2"), (1, "1"), (5, "5b")):
            g.send(obj, 0, tag=tag)
        g.barrier()
        return None

    async def main():
        a = g.aio
        ts = {k: asyncio.ensure_future(a.recv(1, tag=tag, timeout=30))
              for k, tag in (("1", 1), ("2", 2), ("3", 3), ("5a", 5), ("5b", 5))}
        await asyncio.sleep(0.1)
        ts["2"].cancel()
        try:
            await a.recv(1, tag=4, timeout=0.2)
            timed_out = False
        except ctrlcomm.CollectiveTimeoutError:
            timed_out = True
        await a.barrier()
        total = await a.all_reduce(1)
        got = {k: await t for k, t in ts.items() if k != "2"}
        again = await a.recv(1, tag=2, timeout=30)
        await a.barrier()
        return timed_out, ts["2"].cancelled(), total, got, again

    return asyncio.run(main())


def test_a_cancelled_or_timed_out_recv_leaves_the_others_and_the_group_working():
    timed_out, cancelled, total, got, again = run_group(cancelled_among_several, 2,
                                                        timeout=120)[0]
    assert timed_out and cancelled and total == 2
    assert got == {"1": "1", "3": "3", "5a": "5a", "5b": "5b"}, got
    assert again == "2"


def receives_in_call_order(g, n):
    """Rank 0: ``n`` tasks each call recv(1, tag=0), in turn; rank 1 sends 0..n-1 once
    they all wait. Task k gets object k. Twice: the second time the recvs are called with
    some of the objects there already."""
    if g.rank == 1:
        for round_ in range(2):
            g.barrier()
            for i in range(n):
                g.send((round_, i), 0)
        g.barrier()
        return None

    async def main():
        out = []
        for round_ in range(2):
            if round_ == 0:
                ts = [asyncio.ensure_future(g.aio.recv(1, timeout=30)) for _ in range(n)]
                await asyncio.sleep(0.05)  # (they all wait, in order)
                await g.aio.barrier()
            else:
                await g.aio.barrier()
                await asyncio.sleep(0.05)  # (some of the objects are here)
                ts = [asyncio.ensure_future(g.aio.recv(1, timeout=30)) for _ in range(n)]
            out.append(await asyncio.gather(*ts))
        await g.aio.barrier()
        return out

    return asyncio.run(main())


def test_receives_of_one_source_and_tag_take_messages_in_the_order_they_were_called():
    out = run_group(receives_in_call_order, 2, 20, timeout=120)[0]
    assert out == [[(r, i) for i in range(20)] for r in range(2)], out


def receive_while_a_collective_waits(g):
    """Rank 0's awaited all_gather waits for rank 1, which first sends a point-to-point
    object that a recv task of rank 0 waits for (it leads: it waited first): both return."""
    if g.rank == 1:
        time.sleep(0.3)
        g.send("p2p", 0)
        time.sleep(0.3)
        return g.all_gather(1), None

    async def main():
        r = asyncio.ensure_future(g.aio.recv(1, timeout=30))
        await asyncio.sleep(0.05)
        c = asyncio.ensure_future(g.aio.all_gather(0, timeout=30))
        got = await r
        return await c, got

    return asyncio.run(main())


def test_a_collective_runs_while_a_recv_waits():
    res = run_group(receive_while_a_collective_waits, 2, timeout=60)
    assert res[0] == ([0, 1], "p2p") and res[1] == ([0, 1], None)


def closed_while_several_wait(g):
    """Rank 0: two threads' blocking recvs and a task's awaited recv wait (one leads, the
    others follow); close() from the main thread ends them all at once, with
    GroupClosedError."""
    if g.rank == 1:
        g.barrier()
        time.sleep(1.0)
        return None
    out = []

    def blocking():
        try:
            g.recv(1, tag=7, timeout=20)
        except ctrlcomm.CtrlcommError as e:
            out.append(type(e).__name__)

    def awaited():
        async def main():
            try:
                await g.aio.recv(1, tag=8, timeout=20)
            except ctrlcomm.CtrlcommError as e:
                out.append(type(e).__name__)

        asyncio.run(main())

    g.barrier()
    ts = [threading.Thread(target=f) for f in (blocking, blocking, awaited)]
    for t in ts:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    g.close()
    for t in ts:
        t.join(20)
    return sorted(out), time.monotonic() - t0


def test_close_ends_every_waiting_call():
    out, took = run_group(closed_while_several_wait, 2, timeout=60)[0]
    assert out == ["GroupClosedError"] * 3, out
    assert took < 5, took


def collectives_of_two_threads(g):
    """A collective of another thread while one is in progress is refused (their order could
    differ between ranks), not waited for; a recv meanwhile is not."""
    if g.rank == 1:
        time.sleep(0.5)
        g.send("x", 0)
        return g.all_reduce(1), None
    res = {}

    def other():
        time.sleep(0.2)  # (the main thread's all_reduce waits for rank 1 by then)
        try:
            g.barrier(timeout=5)
            res["barrier"] = "ran"
        except ctrlcomm.ConcurrentUseError:
            res["barrier"] = "refused"
        res["recv"] = g.recv(1, timeout=10)

    t = threading.Thread(target=other)
    t.start()
    r = g.all_reduce(1, timeout=10)
    t.join(20)
    return r, res


def test_a_collective_of_another_thread_is_refused_but_a_recv_is_not():
    res = run_group(collectives_of_two_threads, 2, timeout=60)
    assert res[0] == (2, {"barrier": "refused", "recv": "x"}), res
    assert res[1] == (2, None)


def big_sends_beside_a_waiting_recv(g):
    """Rank 0: a recv task waits (it leads) for what rank 1 sends last, while a send task
    sends 24 objects of 1 MiB that rank 1 takes only after 0.5 s: the sends wait out the
    backlog (4 MiB) beside the recv, without its lead. Everything arrives."""
    import numpy as np

    if g.rank == 1:
        time.sleep(0.5)
        sums = [int(g.recv(0, timeout=60).sum()) for _ in range(24)]
        g.send("last", 0, tag=9)
        return sums

    async def main():
        r = asyncio.ensure_future(g.aio.recv(1, tag=9, timeout=60))
        await asyncio.sleep(0.05)
        for i in range(24):
            await g.aio.send(np.full(1 << 17, i, dtype=np.int64), 1, timeout=60)
        return await r

    return asyncio.run(main())


@pytest.mark.parametrize(("kwargs", "local"), TRANSPORTS)
def test_sends_waiting_out_a_backlog_beside_a_waiting_recv(kwargs, local):
    _local(local)
    try:
        res = run_group(big_sends_beside_a_waiting_recv, 2, timeout=120, group_kwargs=kwargs)
    finally:
        os.environ.pop("CTRLCOMM_LOCAL_SOCKETS", None)
    assert res[0] == "last"
    assert res[1] == [i * (1 << 17) for i in range(24)]


def many_receivers(g, n):
    """Rank 0: three threads (blocking) and three tasks of an event loop in a fourth
    thread (awaited) each receive ``n`` objects of their own tag from rank 1, all waiting at
    once, the lead passing between them as they end; rank 1 sends round-robin over the six
    tags, then they trade a barrier."""
    if g.rank == 1:
        for i in range(n):
            for tag in range(6):
                g.send((tag, i), 0, tag=tag)
        g.barrier()
        return None
    got = {tag: [] for tag in range(6)}

    def blocking(tag):
        for _ in range(n):
            got[tag].append(g.recv(1, tag=tag, timeout=60))

    def awaited():
        async def one(tag):
            for _ in range(n):
                got[tag].append(await g.aio.recv(1, tag=tag, timeout=60))

        async def main():
            await asyncio.gather(*[one(tag) for tag in range(3, 6)])

        asyncio.run(main())

    ts = [threading.Thread(target=blocking, args=(tag,)) for tag in range(3)]
    ts.append(threading.Thread(target=awaited))
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    g.barrier()
    return {tag: v == [(tag, i) for i in range(n)] for tag, v in got.items()}


@pytest.mark.parametrize(("kwargs", "local"), TRANSPORTS)
def test_threads_and_tasks_receiving_at_once_each_get_their_own(kwargs, local):
    _local(local)
    try:
        res = run_group(many_receivers, 2, 2000, timeout=300, group_kwargs=kwargs)
    finally:
        os.environ.pop("CTRLCOMM_LOCAL_SOCKETS", None)
    assert res[0] == {tag: True for tag in range(6)}, res


def recv_left_in_a_closed_loop(g):
    """Rank 0: an awaited recv of (1, 0) waits (it leads, first in its line) in a loop driven
    by hand, which is then closed with it pending: it will never resume. A barrier, a
    thread's blocking recv of (1, 0) and a new loop's awaited recv of (1, 1) then take its
    lead and its place, and get what rank 1 sends, within a second or so (not at their
    deadlines)."""
    if g.rank == 1:
        g.barrier()
        g.send("x", 0)
        g.send("y", 0, tag=1)
        g.barrier()
        return None
    loop = asyncio.new_event_loop()
    loop.create_task(g.aio.recv(1, timeout=30))
    loop.run_until_complete(asyncio.sleep(0.1))  # (the recv waits)
    loop.close()
    t0 = time.monotonic()
    g.barrier(timeout=20)
    box = {}
    t = threading.Thread(target=lambda: box.update(x=g.recv(1, timeout=20)))
    t.start()
    y = asyncio.run(g.aio.recv(1, tag=1, timeout=20))
    t.join(30)
    g.barrier(timeout=20)
    return box.get("x"), y, time.monotonic() - t0


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_a_recv_left_in_a_closed_loop_does_not_hold_the_others(transport):
    x, y, took = run_group(recv_left_in_a_closed_loop, 2, timeout=60,
                           group_kwargs={"transport": transport})[0]
    assert (x, y) == ("x", "y")
    assert took < 5, took
