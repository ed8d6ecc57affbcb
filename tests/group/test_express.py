"""The short way a step's messages are read (an express endpoint's drain: see
``_endpoint.Expected``): straight from the sender's socket when a read begins with the
message a waiting rank expects, the general way (decoder, mailbox) for anything else. Real
ranks, real sockets; each test arranges which way a message goes by when the ranks send,
and checks what came out and which way it went (the general way hands each message to the
core's sink: counted here)."""

import asyncio
import os
import time

import pytest

import ctrlcomm
from ctrlcomm._wire import P2P
from ctrlcomm.testing import run_group, run_ranks

pytestmark = pytest.mark.timeout(120)


def count_general(g, kind=None):
    """Count the messages (of ``kind`` only: a w.P2P, say) the core takes the general way
    (its sink) from now on."""
    core = g._core
    seen = [0]
    sink = core._sink

    def counting(m):
        if kind is None or (m is not None and m.kind == kind):
            seen[0] += 1
        return sink(m)

    core._sink = core.ep.sink = counting
    return seen


def settle(g):
    """Make each rank wait once the general way: a rank's first wait looks at its peers'
    liveness that way (their heartbeats), and the short way waits only once that was done.
    (A barrier whose message was there already does not wait: each rank in turn comes
    last, so the others wait for it.)"""
    for r in range(g.world_size):
        if g.rank == r:
            time.sleep(0.05)
        g.barrier()
    g.barrier()


def waiting_receivers(g, awaited):
    """Each call's receivers are waiting before its messages arrive (the senders sleep
    first): every message is read the short way. Returns the results and, per call, how
    many messages went the general way. ``awaited``: the calls through ``g.aio``."""
    settle(g)
    seen = count_general(g)
    out, general = [], []
    api = g.aio if awaited else g

    def call(f):
        before = seen[0]
        r = f()
        out.append(asyncio.run(r) if awaited else r)
        general.append(seen[0] - before)
        g.barrier()

    # broadcast: ranks 1 and 2 wait for the root
    if g.rank == 0:
        time.sleep(0.2)
    call(lambda: api.broadcast({"cfg": [1, 2, 3]} if g.rank == 0 else None, src=0))
    # all_reduce, a star at world 3: the root waits for both others, one after the other,
    # and they wait for its result
    if g.rank != 0:
        time.sleep(0.15 * g.rank)
    call(lambda: api.all_reduce((g.rank, 10 - g.rank), "max"))
    # all_gather: rank 2 first, then the others together
    if g.rank != 2:
        time.sleep(0.2)
    call(lambda: api.all_gather({"r": g.rank}))
    return out, general


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_messages_that_arrive_while_a_rank_waits_are_read_the_short_way(awaited):
    res = run_group(waiting_receivers, 3, awaited, timeout=60)
    for r, (out, general) in enumerate(res):
        assert out == [{"cfg": [1, 2, 3]}, (2, 10), [{"r": 0}, {"r": 1}, {"r": 2}]], (r, out)
        # each message was read straight from its socket, none through the sink
        assert general == [0, 0, 0], (r, general)


def p2p_then_two_ahead(g, awaited):
    seen = count_general(g)
    if awaited:
        def bcast(obj):
            return asyncio.run(g.aio.broadcast(obj, src=0))
    else:
        def bcast(obj):
            return g.broadcast(obj, src=0)
    if g.rank == 0:
        g.send("p2p first", dst=1)  # arrives while rank 1 waits for the broadcast
        time.sleep(0.3)
        a = bcast({"n": 1})
        b = bcast({"n": 2})  # both queued while rank 1 sleeps below
        c = bcast({"n": 3})
        big = bcast(b"x" * (3 << 20))  # more than one read holds it
        g.barrier()
        return [a, b, c, len(big)], None, seen[0]
    a = bcast(None)
    time.sleep(0.5)  # rank 0's next broadcasts reach the socket before this rank reads
    b = bcast(None)
    c = bcast(None)
    big = bcast(None)
    g.barrier()
    return [a, b, c, len(big)], g.recv(0), seen[0]


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_what_the_short_way_does_not_expect_goes_the_general_way_in_order(awaited):
    res = run_group(p2p_then_two_ahead, 2, awaited, timeout=60)
    want = [{"n": 1}, {"n": 2}, {"n": 3}, 3 << 20]
    assert res[0][0] == want and res[1][0] == want, res
    assert res[1][1] == "p2p first"
    # the point-to-point message, the broadcasts read together, and the large one went
    # the general way
    assert res[1][2] >= 3, res


def _refuse(text):
    raise ValueError(text)


class _Refused:
    """Pickles; unpickling it raises."""

    def __reduce__(self):
        return (_refuse, ("not here",))


def undecodable_while_waiting(g, awaited):
    settle(g)
    seen = count_general(g)
    if g.rank == 0:
        time.sleep(0.3)  # rank 1 waits for it: the short way reads it
        g.broadcast(_Refused(), src=0)
        time.sleep(0.3)  # (its next message does not come behind it in the same read)
        try:
            g.barrier(timeout=30)
        except ctrlcomm.GroupBrokenError as e:
            return type(e).__name__, str(e)
        return "barrier returned", ""
    try:
        if awaited:
            asyncio.run(g.aio.broadcast(None, src=0))
        else:
            g.broadcast(None, src=0)
    except ctrlcomm.CodecError as e:
        return type(e).__name__, str(e), g.broken, seen[0]
    return "returned", "", g.broken, seen[0]


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_an_object_read_the_short_way_that_cannot_be_decoded_breaks_the_group(awaited):
    res = run_group(undecodable_while_waiting, 2, awaited, timeout=60)
    kind, text, broken, general = res[1]
    assert kind == "CodecError" and "cannot decode the object from rank 0" in text, res
    assert "ValueError: not here" in text and broken
    assert general == 0  # it was read the short way
    # and the root is told, not left waiting in its next call
    assert res[0][0] == "PeerLostError" and "cannot decode the object from rank 0" in res[0][1]


def closed_while_waiting(g, how):
    """Rank 0 waits the short way for a broadcast rank 1 never sends; 0.2 s in, the group
    is closed: from another task of the loop, from another thread (awaited and blocking)."""
    import threading

    settle(g)
    if g.rank == 1:
        time.sleep(2.0)
        return None
    t = time.monotonic()

    async def awaited():
        if how == "task":
            asyncio.get_running_loop().call_later(0.2, g.close)
        else:
            threading.Timer(0.2, g.close).start()
        return await g.aio.broadcast(None, src=1, timeout=30)

    try:
        if how == "thread, blocking":
            threading.Timer(0.2, g.close).start()
            g.broadcast(None, src=1, timeout=30)
        else:
            asyncio.run(awaited())
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t
    return "returned", "", time.monotonic() - t


@pytest.mark.parametrize("how", ["task", "thread", "thread, blocking"])
def test_a_close_ends_a_call_waiting_the_short_way_at_once(how):
    kind, text, took = run_group(closed_while_waiting, 2, how, timeout=60)[0]
    assert kind == "GroupClosedError" and "closed during the call" in text, (kind, text)
    # at once, not at the first look at the peers' state (FIRST_PROBE, 1 s into the call)
    assert took < 0.9, took


def peer_dies_while_waited_for(rank, size, port, awaited):
    """Rank 1 exits without close() while rank 0 waits for it the short way: the end of its
    stream, read there, names it lost."""
    import os

    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, host_store=False, timeout=60)
    settle(g)
    if rank == 1:
        time.sleep(0.3)
        os._exit(0)
    t = time.monotonic()
    try:
        if awaited:
            asyncio.run(g.aio.broadcast(None, src=1, timeout=30))
        else:
            g.broadcast(None, src=1, timeout=30)
    except ctrlcomm.PeerLostError as e:
        return type(e).__name__, e.ranks, str(e), time.monotonic() - t
    return "returned", [], "", time.monotonic() - t


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_a_peer_that_dies_while_waited_for_the_short_way_is_named_lost(store, awaited):
    res = run_ranks(peer_dies_while_waited_for, 2, store.port, awaited, may_die=(1,),
                    timeout=60)
    kind, ranks, text, took = res[0]
    assert kind == "PeerLostError" and ranks == [1] and "rank 1" in text, res[0]
    assert "connection closed" in text, text
    assert took < 10, took  # (its deadline is 30 s)


def p2p_while_waiting(g, awaited):
    """Rank 1 waits in recv while rank 0 sends: the next message rank 0 numbered for it,
    with the tag it waits for, is read the short way; one with another tag that comes first
    goes the general way, and both are received, each by its tag. (Counted: the
    point-to-point messages that went the general way; the barrier's come right behind.)"""
    settle(g)
    seen = count_general(g, P2P)
    if g.rank == 0:
        for obj, tag in [({"x": 1}, 5), ([2, 3], 5)]:
            time.sleep(0.2)  # rank 1 waits for it
            g.send(obj, dst=1, tag=tag)
            g.barrier()
        time.sleep(0.2)
        g.send("tag 7 first", dst=1, tag=7)  # while rank 1 waits for tag 5
        time.sleep(0.2)
        g.send("then 5", dst=1, tag=5)
        g.barrier()
        return None

    def recv(tag):
        return asyncio.run(g.aio.recv(0, tag=tag)) if awaited else g.recv(0, tag=tag)

    out, general = [], []
    for _ in range(2):
        before = seen[0]
        out.append(recv(5))
        general.append(seen[0] - before)
        g.barrier()
    before = seen[0]
    out.append(recv(5))
    out.append(recv(7))
    general.append(seen[0] - before)
    g.barrier()
    return out, general


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_a_message_received_point_to_point_while_waiting_is_read_the_short_way(awaited):
    out, general = run_group(p2p_while_waiting, 2, awaited, timeout=60)[1]
    assert out == [{"x": 1}, [2, 3], "then 5", "tag 7 first"], out
    # the first two straight from the socket; of the last two, the one with another tag
    # went the general way, and the next, with the tag waited for, the short way (the recv
    # expects the number after the one that passed)
    assert general == [0, 0, 1], general


def undecodable_p2p(g, awaited):
    settle(g)
    seen = count_general(g, P2P)
    if g.rank == 0:
        time.sleep(0.3)  # rank 1 waits for it: the short way reads it
        g.send(_Refused(), dst=1)
        time.sleep(0.3)  # (not behind it in the same read)
        g.send("next", dst=1)
        return g.all_gather(g.rank)
    try:
        if awaited:
            asyncio.run(g.aio.recv(0))
        else:
            g.recv(0)
    except ctrlcomm.CodecError as e:
        got = type(e).__name__, str(e), seen[0]
    else:
        got = "returned", "", seen[0]
    # as the general way leaves it: the message is gone, the group goes on
    return got, g.recv(0), g.all_gather(g.rank)


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_a_point_to_point_object_read_the_short_way_that_cannot_be_decoded_is_the_recvs_error(
        awaited):
    res = run_group(undecodable_p2p, 2, awaited, timeout=60)
    (kind, text, general), nxt, gathered = res[1]
    assert kind == "CodecError" and "recv(src=0, tag=0)" in text, res
    assert "cannot decode the object from rank 0" in text and "ValueError: not here" in text
    assert general == 0  # it was read the short way
    assert nxt == "next" and gathered == [0, 1] and res[0] == [0, 1]


def closed_while_receiving(g, awaited):
    import threading

    settle(g)
    if g.rank == 1:
        time.sleep(2.0)
        return None
    t = time.monotonic()
    threading.Timer(0.2, g.close).start()
    try:
        if awaited:
            asyncio.run(g.aio.recv(1, timeout=30))
        else:
            g.recv(1, timeout=30)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t
    return "returned", "", time.monotonic() - t


@pytest.mark.parametrize("awaited", [False, True], ids=["blocking", "awaited"])
def test_a_close_ends_a_recv_waiting_the_short_way_at_once(awaited):
    kind, text, took = run_group(closed_while_receiving, 2, awaited, timeout=60)[0]
    assert kind == "GroupClosedError", (kind, text)
    assert took < 0.9, took


def cancelled_after_its_read(g, how):
    """Rank 1's awaited recv is cancelled in the loop's turn whose reader callback read its
    message the short way (the loop stalled while it came): the message is the next recv's,
    as when the general way had queued it."""
    settle(g)
    if g.rank == 0:
        g.barrier()
        time.sleep(0.2)
        g.send("A", 1)
        g.barrier()  # rank 1's recv has ended
        g.send("B", 1)
        return None
    g.barrier()

    async def stall():
        await asyncio.sleep(0.05)  # (the recv waits, on the loop)
        time.sleep(0.5)  # noqa: ASYNC251  # the loop stalls (on purpose): "A" comes meanwhile

    async def main():
        if how == "cancel":
            t = asyncio.create_task(g.aio.recv(0))
            await stall()
            asyncio.get_running_loop().call_later(0, t.cancel)  # due in the turn that reads
            try:
                return "got", await t
            except asyncio.CancelledError:
                return "cancelled", None
        s = asyncio.create_task(stall())
        try:
            async with asyncio.timeout(0.2):  # (cancels the recv, in the same turn)
                return "got", await g.aio.recv(0)
        except TimeoutError:
            return "timed out", None
        finally:
            await s

    first = asyncio.run(main())
    g.barrier()
    return first, g.recv(0, timeout=10), g.recv(0, timeout=10) if first[0] != "got" else None


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_recv_cancelled_after_its_message_was_read_leaves_it_for_the_next(how):
    if how == "timeout" and not hasattr(asyncio, "timeout"):
        pytest.skip("asyncio.timeout: Python 3.11+")
    first, nxt, then = run_group(cancelled_after_its_read, 2, how, timeout=60)[1]
    if first[0] == "got":  # (the cancel came too late: the recv returned it)
        assert first[1] == "A" and nxt == "B", (first, nxt)
    else:
        assert (nxt, then) == ("A", "B"), (first, nxt, then)



def wait_for_file(path, deadline=20.0):
    end = time.monotonic() + deadline
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} never came"
        time.sleep(0.01)


def reader_fails_and_call_cancelled(g, what, flags):
    """Rank 1's awaited recv (or broadcast) waits the short way; the reader callback that
    wakes it fails, and the call is cancelled in the same turn of the loop, before it could
    resume to raise the failure: the group breaks there and rank 0 is told at once (rank 1
    stays until rank 0 has heard), rather than a later call of rank 1 raising that failure
    as its own."""
    settle(g)
    waiting, heard = os.path.join(flags, "waiting"), os.path.join(flags, "heard")
    if g.rank == 0:
        wait_for_file(waiting)
        time.sleep(0.05)
        if what == "recv":
            g.send("A", 1)
        else:
            g.broadcast("A", src=0)
        try:
            g.barrier(timeout=10)  # rank 1's group broke: it never comes
        except ctrlcomm.CtrlcommError as e:
            out = type(e).__name__, str(e)
        else:
            out = "returned", ""
        open(heard, "w").close()
        return out
    ep = g._core.ep

    async def main():
        t = asyncio.create_task(g.aio.recv(0) if what == "recv" else g.aio.broadcast(None, src=0))

        def failing(sink):
            t.cancel()
            raise RuntimeError("the reader failed")

        ep.drain = failing  # (what the reader callback calls)
        await asyncio.sleep(0.05)  # (the call waits, on the loop)
        open(waiting, "w").close()  # noqa: ASYNC230  # (a flag for rank 0: instant)
        try:
            return "got", await t
        except asyncio.CancelledError:
            return "cancelled", None
        finally:
            del ep.drain

    first = asyncio.run(main())
    try:
        g.recv(0, timeout=5)
    except Exception as e:  # noqa: BLE001  # (what the next call raises is the point)
        nxt = (type(e).__name__, str(e))
    else:
        nxt = ("returned", "")
    wait_for_file(heard)
    g.close()
    return first, nxt


@pytest.mark.parametrize("what", ["recv", "broadcast"])
def test_a_failure_of_the_reader_of_a_cancelled_call_breaks_the_group_and_tells_the_others(
        what, tmp_path):
    told, (first, nxt) = run_group(reader_fails_and_call_cancelled, 2, what, str(tmp_path),
                                   timeout=60)
    assert first == ("cancelled", None), first
    assert nxt[0] == "GroupBrokenError", nxt
    if what == "recv":
        assert "the reader failed" in nxt[1], nxt
        assert told[0] == "PeerLostError" and "failed on rank 1 as it was cancelled" in told[1] \
            and "the reader failed" in told[1], told
    else:  # (a collective's cancellation says so)
        assert told[0] == "PeerLostError" and "was cancelled on rank 1" in told[1], told
