"""Lost peers: killed, stopped, aborting. Every survivor fails fast, naming the lost rank."""

import asyncio
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import ctrlcomm
from ctrlcomm import _wire as w
from ctrlcomm.testing import run_group, run_ranks


def _group(rank, size, port, **kw):
    return ctrlcomm.Group.create("127.0.0.1", port, rank, size, host_store=False,
                                 timeout=kw.pop("timeout", 60), name=kw.pop("name", "live"), **kw)


def killed_mid_collective(rank, size, port):
    g = _group(rank, size, port)
    g.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    try:
        g.barrier()
    except ctrlcomm.PeerLostError as e:
        took = time.monotonic() - t
        try:
            g.all_reduce(1)
        except ctrlcomm.GroupBrokenError as again:
            later = str(again)
        return e.ranks, str(e), took, later
    return "no error"


def test_killed_process_is_detected_fast(store):
    res = run_ranks(killed_mid_collective, 4, store.port, may_die=(2,))
    for r in (0, 1, 3):
        ranks, msg, took, later = res[r]
        print(f"kill -9: rank {r} raised after {took:.3f} s: {msg}")
        assert 2 in ranks or "rank 2" in msg, msg
        assert took < 3.0, f"rank {r} took {took:.2f} s to notice"
        assert "broken" in later


def stopped_mid_collective(rank, size, port):
    g = _group(rank, size, port, liveness_timeout=2.0, heartbeat_interval=0.25)
    g.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills it at the end
        return None
    t = time.monotonic()
    try:
        g.all_reduce(rank)
    except ctrlcomm.PeerLostError as e:
        return e.ranks, str(e), time.monotonic() - t
    return "no error"


def test_stopped_process_is_detected_by_heartbeats(store):
    res = run_ranks(stopped_mid_collective, 3, store.port, may_die=(1,), timeout=30,
                    kill_after_results=True)
    for r in (0, 2):
        ranks, msg, took = res[r]
        print(f"SIGSTOP (liveness_timeout=2): rank {r} raised after {took:.2f} s: {msg}")
        assert ranks == [1] and "heartbeats" in msg, msg
        assert 1.5 < took < 4.5, took


def aborting(rank, size, port):
    g = _group(rank, size, port)
    g.barrier()
    if rank == 1:
        time.sleep(0.3)
        g.abort("out of memory on the GPU")
        try:
            g.barrier()
        except ctrlcomm.GroupBrokenError as e:
            return "self", str(e)
    t = time.monotonic()
    try:
        g.barrier()
    except ctrlcomm.PeerLostError as exc:
        err, took = exc, time.monotonic() - t
    else:
        return "no error"
    # survivors form a new group on the same store, without restarting
    survivors = [r for r in range(size) if r != 1]
    with ctrlcomm.Group.create("127.0.0.1", port, survivors.index(rank), len(survivors),
                               host_store=False, name="live-2", timeout=30) as g2:
        again = g2.all_gather(rank)
    return err.ranks, str(err), took, again


def test_abort_tells_every_peer_and_survivors_reform(store):
    res = run_ranks(aborting, 4, store.port)
    assert res[1][0] == "self" and "aborted" in res[1][1]
    for r in (0, 2, 3):
        ranks, msg, took, again = res[r]
        assert ranks == [1] and "out of memory on the GPU" in msg
        assert took < 2.0
        assert again == [0, 2, 3]


def abort_read_with_last_message(rank, size, port, early, aio):
    """Rank 1 sends its all_gather contribution and, in the same write, an abort (as a rank
    does that completes a call and fails in the next): rank 0 reads both at once."""
    g = _group(rank, size, port, name=f"abort-late-{early}-{aio}")
    g.barrier()
    core = g._core
    if rank == 1:
        # not before rank 0 is out of the barrier: read with the barrier's message, the
        # abort would break the group before the all_gather (which then rightly raises)
        g.store.wait([f"{g.name}/0 left the barrier"], timeout=30)
        [mine] = w.stream_messages([0], w.COLL, 1, core.group_id, core.seq, 0,
                                   w.OP_CODE["all_gather"], w.NO_ROOT, w.PICKLE,
                                   pickle.dumps("from 1", protocol=5), core.key)
        abort = w.encode(w.Message(w.ABORT, 1, core.group_id, 0, 0,
                                   payload=b"failed in the next call"), core.key, 0)
        core.ep.send_framed([0], [mine + w.stream_prefix(abort) + b"".join(abort)])
        try:
            g.recv(0, timeout=20)  # until rank 0 is done and closes the group
        except ctrlcomm.PeerLostError:
            pass
        return None
    g.store.set(f"{g.name}/0 left the barrier", "1")
    if early:
        time.sleep(0.3)  # both messages are in the socket before the call starts
    got = asyncio.run(g.aio.all_gather("from 0")) if aio else g.all_gather("from 0")
    try:
        g.barrier()
    except ctrlcomm.GroupBrokenError as e:  # broken before the call: it says why
        return got, e.__cause__.ranks, str(e)
    return got, "no error"


@pytest.mark.parametrize(("early", "aio"), [(False, False), (True, False), (False, True)],
                         ids=["sent-right-away", "there-before-the-call", "awaited"])
def test_a_call_completed_before_an_abort_returns_and_the_next_raises(store, early, aio):
    res = run_ranks(abort_read_with_last_message, 2, store.port, early, aio)
    got, ranks, msg = res[0]
    assert got == ["from 0", "from 1"]  # raised PeerLostError before the fix
    assert ranks == [1] and "rank 1 aborted" in msg and "failed in the next call" in msg


def idle_peer_is_not_lost(rank, size, port):
    g = _group(rank, size, port, liveness_timeout=1.0, heartbeat_interval=0.2)
    if rank == 1:
        time.sleep(3.0)  # idle (not in any call) for longer than the liveness timeout
    return g.all_reduce(1)


def test_an_idle_but_alive_peer_is_waited_for(store):
    assert run_ranks(idle_peer_is_not_lost, 2, store.port) == [2, 2]


def _gil_rate():
    """Seconds per item of ``any(repeat(0, n))`` here: the fastest of five runs of about 0.06
    s each (a rate measured while a busy moment slowed it would make a hold too short)."""
    per = []
    for _ in range(5):
        t = time.perf_counter()
        any(itertools.repeat(0, 10_000_000))
        per.append(time.perf_counter() - t)
    return max(min(per), 1e-6) / 10_000_000


def _hold_gil(seconds, rate):
    """One C call that holds the GIL for about ``seconds`` at the rate of a short run, and
    in practice less: a long run of it goes faster per item here (measured: 10 s asked, 7 s
    held), so callers ask for more than they need. No Python runs meanwhile, so no other
    thread of this process does either."""
    t = time.monotonic()
    any(itertools.repeat(0, int(seconds / rate)))
    return time.monotonic() - t


def gil_held_by_peer(rank, size, port, how, liveness=1.0):
    g = _group(rank, size, port, liveness_timeout=liveness, heartbeat_interval=liveness / 5)
    g.barrier()
    # measured while rank 0 waits in the barrier (a quiet machine), before it times its call
    rate = _gil_rate() if rank == 1 else None
    g.barrier()
    held = None
    if rank == 1:
        if how == "running":
            held = _hold_gil(4.0, rate)
        elif how == "too long":  # longer than the wait a running peer gets (12 timeouts)
            held = _hold_gil(14.0, rate)
        else:  # asleep with the GIL held, every thread waiting: hung
            import ctypes

            t = time.monotonic()
            ctypes.PyDLL(None).usleep(3_000_000)  # a PyDLL call keeps the GIL
            held = time.monotonic() - t
    t = time.monotonic()
    try:
        got = g.all_reduce(rank + 1)
    except ctrlcomm.GroupBrokenError as e:
        got = e
    took = time.monotonic() - t
    if rank == 1 and how != "running":
        # it may complete that call (rank 0's part came before rank 0 gave up on it); the
        # group is broken all the same, as the next call says
        try:
            got = got, g.barrier(timeout=10)
        except ctrlcomm.GroupBrokenError as e:
            got = got, e
    return got, held, took


def test_a_peer_of_this_host_running_a_long_c_call_that_holds_the_gil_is_waited_for(store):
    # its heartbeat thread cannot send meanwhile: it is silent for three liveness timeouts,
    # but its process runs; and its own check afterwards reads the heartbeats that waited
    (got0, _, waited), (got1, held, _) = run_ranks(gil_held_by_peer, 2, store.port,
                                                   "running", timeout=60)
    print(f"GIL held {held:.1f} s by rank 1 (liveness_timeout=1): rank 0 waited {waited:.1f} s")
    assert held > 2.0, held
    assert got0 == got1 == 3, (got0, got1)
    assert waited > 2.0, waited


def test_a_peer_of_this_host_asleep_with_the_gil_held_is_lost(store):
    (got0, _, waited), (got1, held, _) = run_ranks(gil_held_by_peer, 2, store.port,
                                                   "asleep", timeout=60)
    print(f"rank 1 asleep {held:.1f} s with the GIL held: rank 0 raised after {waited:.1f} s")
    assert isinstance(got0, ctrlcomm.PeerLostError) and got0.ranks == [1], got0
    assert "heartbeats" in str(got0)
    assert 0.7 < waited < 2.9, waited
    assert isinstance(got1[1], ctrlcomm.GroupBrokenError), got1


def test_a_running_but_silent_peer_is_waited_for_twelve_liveness_timeouts_at_most(store):
    (got0, _, waited), (got1, held, _) = run_ranks(gil_held_by_peer, 2, store.port,
                                                   "too long", 0.5, timeout=60)
    print(f"GIL held {held:.1f} s (liveness_timeout=0.5): rank 0 raised after {waited:.1f} s")
    assert held > 7.0, held
    assert isinstance(got0, ctrlcomm.PeerLostError) and got0.ranks == [1], got0
    assert 5.0 < waited < 7.0, waited
    assert isinstance(got1[1], ctrlcomm.GroupBrokenError), got1


def _state(pid):
    from ctrlcomm.transport._net import _proc_stat

    return _proc_stat(f"/proc/{pid}/stat")[0]


def test_running_tells_a_busy_process_from_a_stopped_sleeping_exited_or_other_one():
    from ctrlcomm.transport._heartbeat import Heartbeat
    from ctrlcomm.transport._net import _proc_stat, proc_address, same_host_procs

    hb = Heartbeat("127.0.0.1", 1, 0, None, 1.0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    asleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while (_state(busy.pid), _state(asleep.pid)) != (b"R", b"S"):  # started, settled
            assert time.monotonic() < deadline, (_state(busy.pid), _state(asleep.pid))
            time.sleep(0.05)
        start = {p.pid: int(_proc_stat(f"/proc/{p.pid}/stat")[19]) for p in (busy, asleep, done)}
        done.wait(10)
        hb.procs = {1: (busy.pid, start[busy.pid]), 2: (asleep.pid, start[asleep.pid]),
                    3: (busy.pid, start[busy.pid] + 1), 4: (done.pid, start[done.pid])}
        assert hb.running(1) is None  # a first look cannot tell: look again
        assert hb.running(2) is None
        time.sleep(0.25)
        assert hb.running(1) is True  # it used a CPU since the last look
        assert hb.running(2) is False  # it used none: hung
        time.sleep(0.25)
        assert hb.running(1) is True
        assert hb.running(2) is False
        # looks closer together than its CPU time's tick (10 ms), as a busy loop of calls
        # makes on every wait: what the last window found, never "not running" for a busy
        # process that no tick was counted to in between (before: False, the peer lost)
        for _ in range(50):
            assert hb.running(1) is True
            assert hb.running(2) is False
            time.sleep(0.0005)
        assert hb.running(3) is False  # another start time: that process is gone
        assert hb.running(4) is False  # exited
        assert hb.running(5) is False  # not a process of this host
        os.kill(busy.pid, signal.SIGSTOP)
        while _state(busy.pid) != b"T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert hb.running(1) is False  # stopped
    finally:
        for p in (busy, asleep):
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        hb.sock.close()
    # what a rank publishes: only a process of this host, PID namespace and user matches
    me = proc_address()
    key, pid, _ = me.split(":")[1:]
    assert int(pid) == os.getpid()
    assert same_host_procs({0: me, 1: f"proc:{key}:42:7", 2: "proc:0000000000000000:42:7",
                            3: "proc:bad"}, me) == {1: (42, 7)}


def test_catch_up_reads_the_heartbeats_waiting_in_the_socket_without_waiting():
    from ctrlcomm.transport._heartbeat import Heartbeat

    a, b = (Heartbeat("127.0.0.1", 7, r, b"k" * 32, 5.0) for r in (0, 1))
    try:
        b.peers, b.last_seen = {0: ("127.0.0.1", a.port)}, {0: 0.0}  # thread not started
        for n in range(1, 6):
            a.sock.sendto(a.datagram(1, n), ("127.0.0.1", b.port))
        time.sleep(0.1)
        t = time.monotonic()
        b.catch_up()
        assert b.last_seen[0] >= t
        t = time.monotonic()
        b.catch_up()  # nothing waiting: returns at once, not after the socket's 5 s timeout
        assert time.monotonic() - t < 1.0
    finally:
        a.sock.close()
        b.sock.close()


def test_a_heartbeat_thread_that_outlives_close_ends_without_an_error(monkeypatch):
    """close() waits a second for the heartbeat thread, then closes its socket: in a starved
    process (300 ranks on 2 CPUs) the thread ran on after that and died with a traceback
    (settimeout on the closed socket: EBADF)."""
    from ctrlcomm.transport._heartbeat import Heartbeat

    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    slow = threading.Event()

    class Starved(Heartbeat):
        def datagram(self, dst, n):
            if slow.is_set():
                time.sleep(1.5)  # the thread does not run for longer than close() waits
            return super().datagram(dst, n)

    hb = Starved("127.0.0.1", 7, 0, b"k" * 32, 0.05)
    hb.start({1: ("127.0.0.1", 9)})  # (a port nobody reads: datagrams are dropped)
    time.sleep(0.2)
    slow.set()
    time.sleep(0.1)  # the thread is in datagram() now, or gets there at its next beat
    hb.close()
    assert hb._thread is not None
    hb._thread.join(5.0)
    assert not hb._thread.is_alive()
    assert errors == []


def test_a_replayed_heartbeat_or_one_made_for_another_rank_is_dropped():
    """A recorded heartbeat sent again (to its rank or another) would keep a stopped peer
    looking alive; one made for another rank does not pass either."""
    from ctrlcomm.transport._heartbeat import Heartbeat

    key = b"k" * 16
    a, b = (Heartbeat("127.0.0.1", 7, r, key, 5.0) for r in (0, 1))
    to_b = ("127.0.0.1", b.port)
    try:
        b.peers, b.last_seen = {0: ("127.0.0.1", a.port)}, {0: 0.0}  # thread not started

        def taken(datagram):
            b.last_seen[0] = 0.0
            a.sock.sendto(datagram, to_b)
            time.sleep(0.05)
            b.catch_up()
            return b.last_seen[0] > 0

        assert taken(a.datagram(1, 3))
        assert not taken(a.datagram(1, 3))  # the same beat again
        assert not taken(a.datagram(1, 2))  # an older one
        assert not taken(a.datagram(2, 4))  # beat 4, made for rank 2
        assert taken(a.datagram(1, 4))
        assert b.dropped == {"heartbeat_replayed": 2, "heartbeat_unauthenticated": 1}
        other = Heartbeat("127.0.0.1", 8, 0, key, 5.0)  # another group's
        other.sock.close()
        a.sock.sendto(b"garbage", to_b)
        a.sock.sendto(other.datagram(1, 9), to_b)
        time.sleep(0.05)
        b.catch_up()
        assert b.dropped["heartbeat_malformed"] == 1 and b.dropped["heartbeat_other_group"] == 1
    finally:
        a.sock.close()
        b.sock.close()


def _heartbeat_garbage(rank, size, port):
    g = _group(rank, size, port)
    if rank == 1:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"not a heartbeat", ("127.0.0.1", g._core.hb.port))
        time.sleep(0.3)
    dropped = g.stats()["dropped"]
    g.barrier()
    g.close()
    return dropped


def test_dropped_heartbeats_are_counted_in_stats(store):
    # (before: counted apart, and stats() did not show them)
    assert run_ranks(_heartbeat_garbage, 2, store.port)[1].get("heartbeat_malformed") == 1


@pytest.mark.parametrize("n", [2])
def test_heartbeats_cost_no_busy_cpu(store, n):
    res = run_ranks(_idle_cpu, n, store.port)
    for cpu in res:
        assert cpu < 0.2, f"{cpu:.3f} s of CPU in 2 s idle"


def _idle_cpu(rank, size, port):
    g = _group(rank, size, port, heartbeat_interval=0.1)
    c = time.process_time()
    time.sleep(2.0)
    used = time.process_time() - c
    g.close()
    return used


def watchdog(rank, size, port, what, transport, aio):
    """Rank 0 waits in a call rank 1 never makes; a watchdog thread of rank 0 aborts (or
    closes) the group after 0.3 s: the waiting call must end then, not at its deadline."""
    g = _group(rank, size, port, name=f"watchdog-{what}-{transport}-{aio}",
               transport=transport, liveness_timeout=None)
    g.barrier()
    if rank == 1:
        # holds still (no heartbeats judged, no message sent) until rank 0 is done
        g.store.wait([f"watchdog-{what}-{transport}-{aio} done"], timeout=60)
        return None

    def later():
        time.sleep(0.3)
        g.abort("watchdog: step hung") if what == "abort" else g.close()

    threading.Thread(target=later, daemon=True).start()
    t = time.monotonic()
    try:
        if aio:
            asyncio.run(g.aio.all_reduce(1, timeout=30))
        else:
            g.all_reduce(1, timeout=30)
    except ctrlcomm.CtrlcommError as e:
        took = time.monotonic() - t
        err = (type(e).__name__, str(e), took, g.closed, g.broken)
    else:
        err = "no error"
    # (close() closed the group's own store client)
    st = ctrlcomm.StoreClient("127.0.0.1", port, prefix=f"ctrlcomm/watchdog-{what}-"
                              f"{transport}-{aio}/", timeout=30)
    st.set(f"watchdog-{what}-{transport}-{aio} done", b"1")
    st.close()
    return err


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
@pytest.mark.parametrize("aio", [False, True], ids=["blocking", "awaited"])
@pytest.mark.parametrize("what", ["abort", "close"])
def test_abort_or_close_from_another_thread_ends_a_waiting_call_at_once(store, what,
                                                                         transport, aio):
    name, msg, took, closed, broken = run_ranks(watchdog, 2, store.port, what, transport,
                                                aio)[0]
    assert took < 5.0, f"the call ended {took:.1f} s after it began (abort at 0.3 s)"
    if what == "abort":
        assert name == "GroupBrokenError" and "watchdog: step hung" in msg and broken, msg
    else:
        assert name == "GroupClosedError" and closed, msg


def watchdog_of_a_stuck_loop(rank, size, port, transport, op):
    """Rank 0's awaited call (a recv, or an all_reduce rank 1 is not in) holds the group,
    suspended; then its event loop is stuck (a blocking call in a task, 6 s), and a
    watchdog thread aborts the group at 1 s. Rank 1 waits in a recv from rank 0."""
    name = f"stuck-{transport}-{op}"
    g = _group(rank, size, port, name=name, transport=transport, liveness_timeout=None)
    g.barrier()
    t0 = time.monotonic()
    if rank == 1:
        try:
            g.recv(0, timeout=30)
            return "no error", "", 0.0
        except ctrlcomm.CtrlcommError as e:
            return type(e).__name__, str(e), time.monotonic() - t0
        finally:
            g.store.set(f"{name} done", b"1")
    aborted = []

    def watchdog():
        time.sleep(1.0)
        g.abort("watchdog: event loop stuck")
        aborted.append(time.monotonic() - t0)

    async def main():
        call = asyncio.ensure_future(g.aio.recv(1, timeout=60) if op == "recv"
                                     else g.aio.all_reduce(1, timeout=60))
        await asyncio.sleep(0.2)  # (the call waits)
        threading.Thread(target=watchdog).start()
        time.sleep(6.0)  # noqa: ASYNC251  (the loop is stuck: what the watchdog is for)
        try:
            await call
            return "returned", ""
        except ctrlcomm.CtrlcommError as e:
            return type(e).__name__, str(e)

    out = asyncio.run(main())
    g.store.wait([f"{name} done"], timeout=60)
    return out, aborted


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
@pytest.mark.parametrize("op", ["recv", "all_reduce"])
def test_a_watchdogs_abort_goes_out_while_the_awaited_calls_event_loop_is_stuck(store,
                                                                              transport, op):
    # (before: the word waited for rank 0's loop to run again: rank 1 learnt at 6 s, and,
    # had the loop stayed stuck, only at its own 30 s deadline, naming no abort)
    ((name0, msg0), aborted), (name1, msg1, took) = run_ranks(
        watchdog_of_a_stuck_loop, 2, store.port, transport, op, timeout=90)
    assert aborted and aborted[0] < 3.0, aborted  # (abort() itself returned at once)
    assert name1 == "PeerLostError" and "rank 0 aborted the group" in msg1 \
        and "watchdog: event loop stuck" in msg1, msg1
    assert took < 4.0, took  # (told at ~1 s; 6 s before, when rank 0's loop ran again)
    # and rank 0's call, as its loop runs again, raises: the group is broken
    assert name0 == "GroupBrokenError" and "watchdog: event loop stuck" in msg0, msg0


class _Interrupted(BaseException):
    """What a test's signal handler raises (as Ctrl-C's KeyboardInterrupt would)."""


def abort_in_a_signal_handler_mid_read(rank, size, port):
    """Rank 1 awaits recvs of 8 MB messages from rank 0 (TCP); a signal handler calls
    abort() while the event loop's reader callback reads one, holding the sockets' lock."""
    name = "sig-mid-read"
    g = _group(rank, size, port, name=name, transport="tcp", liveness_timeout=None)
    g.barrier()
    if rank == 0:
        big = b"x" * (8 << 20)
        try:
            for _ in range(400):
                g.send(big, 1, timeout=30)
            g.recv(1, timeout=30)
            return "no error"
        except ctrlcomm.CtrlcommError as e:
            return type(e).__name__
    hit = []

    def handler(signum, frame):
        f, names = frame, set()
        while f is not None:
            names.add(f.f_code.co_name)
            f = f.f_back
        if hit or "_on_readable" not in names:
            return
        hit.append(None)
        t = time.monotonic()
        g.abort("from a signal handler")
        hit[0] = time.monotonic() - t

    signal.signal(signal.SIGUSR1, handler)
    done = threading.Event()

    def pinger():
        while not done.is_set() and not hit:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            time.sleep(0.0005)

    async def main():
        threading.Thread(target=pinger, daemon=True).start()
        try:
            for _ in range(400):
                await g.aio.recv(0, timeout=30)
            return "no error"
        except ctrlcomm.CtrlcommError as e:
            return type(e).__name__
        finally:
            done.set()

    err = asyncio.run(main())
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    return err, hit, g.broken


def test_abort_in_a_signal_handler_while_the_loops_reader_callback_reads_is_at_once(store):
    # (before: the handler's abort() waited for the lock its own thread held, in the reader
    # callback it interrupted: the loop blocked 1 s, then the word went out anyway)
    err0, (err1, hit, broken) = run_ranks(abort_in_a_signal_handler_mid_read, 2, store.port,
                                          timeout=90)
    assert hit and hit[0] is not None, "the handler never ran in the reader callback"
    assert hit[0] < 0.5, f"abort() in the signal handler took {hit[0]:.2f} s"
    assert err1 == "GroupBrokenError" and broken, err1
    assert err0 in ("PeerLostError", "GroupBrokenError"), err0


def _pair_of_recv(rank, size, port, name, transport):
    """The group of the tests below, formed: on rank 0, (group, None); rank 1 returns what
    its recv from rank 0 raises, (None, that), staying until rank 0 is done."""
    g = _group(rank, size, port, name=name, transport=transport, liveness_timeout=None)
    g.barrier()
    if rank == 0:
        return g, None
    try:
        g.recv(0, timeout=30)
        return None, "no error"
    except ctrlcomm.CtrlcommError as e:
        return None, type(e).__name__
    finally:
        g.store.wait([f"{name} done"], timeout=60)


def interrupted_while_a_watchdog_sends(rank, size, port, transport):
    """Rank 0's awaited recv is suspended, its loop stuck; a watchdog's abort() sends from its
    thread, slowly (its send held 1 s: the window made wide); the loop runs again and the call,
    resuming, waits for the sockets; a signal handler raises meanwhile (Ctrl-C)."""
    name = f"sig-wd-{transport}"
    g, rank1 = _pair_of_recv(rank, size, port, name, transport)
    if g is None:
        return rank1
    ep = g._core.ep
    real_send = ep.send

    def slow_send(*a, **k):
        if threading.current_thread().name == "watchdog":
            time.sleep(1.0)
        return real_send(*a, **k)

    ep.send = slow_send
    wd = {}

    def watchdog():
        time.sleep(0.3)
        try:
            g.abort("watchdog")
            wd["abort"] = "returned"
        except BaseException as e:
            wd["abort"] = f"raised {type(e).__name__}: {e}"

    def handler(signum, frame):
        raise _Interrupted()

    signal.signal(signal.SIGUSR1, handler)

    def interrupt():
        time.sleep(1.0)  # (the loop runs again at 0.8 s; the watchdog sends until 1.3 s)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    async def main():
        call = asyncio.ensure_future(g.aio.recv(1, timeout=30))
        await asyncio.sleep(0.05)
        threading.Thread(target=watchdog, name="watchdog").start()
        threading.Thread(target=interrupt).start()
        time.sleep(0.8)  # noqa: ASYNC251  (the loop is stuck)
        return await call

    loop = asyncio.new_event_loop()
    try:
        got = loop.run_until_complete(main())
    except BaseException as e:
        got = type(e).__name__
    finally:
        try:
            loop.run_until_complete(asyncio.sleep(0))  # (what the interrupt left, cancelled)
        except BaseException:
            pass
    time.sleep(1.0)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    ep.send = real_send
    out = got, wd.get("abort"), ep.io.acquire(False), ep.held_async
    g.store.set(f"{name} done", b"1")
    return out


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_an_interrupt_while_a_resumed_call_waits_for_a_watchdogs_send(store, transport):
    # (before, zmq: the interrupted call released the lock the watchdog held: the watchdog's
    # abort() raised "release unlocked lock", and held_async stayed set for good)
    (got, abort, free, held_async), err1 = run_ranks(interrupted_while_a_watchdog_sends, 2,
                                                     store.port, transport, timeout=90)
    assert abort == "returned", abort
    assert free and not held_async, (free, held_async)
    assert got in ("_Interrupted", "GroupBrokenError"), got
    assert err1 == "PeerLostError", err1


def close_while_a_watchdog_sends(rank, size, port, transport):
    """As above, but no interrupt: another thread closes the group while the watchdog's abort
    is sending for the suspended call (the loop stuck). The close waits for the loop's
    thread: the loop still watches the sockets it closes."""
    name = f"close-wd-{transport}"
    g, rank1 = _pair_of_recv(rank, size, port, name, transport)
    if g is None:
        return rank1
    ep = g._core.ep
    real_send, real_close = ep.send, ep.close
    closed_by = []

    def slow_send(*a, **k):
        if threading.current_thread().name == "watchdog":
            time.sleep(0.6)
        return real_send(*a, **k)

    def close(*a, **k):
        closed_by.append(threading.current_thread().name)
        return real_close(*a, **k)

    ep.send, ep.close = slow_send, close
    threads = [threading.Thread(target=lambda: (time.sleep(0.3), g.abort("watchdog")),
                                name="watchdog"),
               threading.Thread(target=lambda: (time.sleep(0.6), g.close()), name="closer")]

    async def main():
        call = asyncio.ensure_future(g.aio.recv(1, timeout=30))
        await asyncio.sleep(0.05)
        for t in threads:
            t.start()
        time.sleep(1.5)  # noqa: ASYNC251  (the loop is stuck)
        try:
            await call
            return "no error"
        except ctrlcomm.CtrlcommError as e:
            return type(e).__name__

    got = asyncio.run(main())
    for t in threads:
        t.join(10)
    st = ctrlcomm.StoreClient("127.0.0.1", port, prefix=f"ctrlcomm/{name}/", timeout=30)
    st.set(f"{name} done", b"1")
    st.close()
    return got, closed_by, g.closed


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
def test_a_close_asked_while_a_watchdogs_abort_sends_is_done_by_the_loops_thread(store,
                                                                                transport):
    # (before: the watchdog's thread, sending the abort, ran the close queued meanwhile too,
    # closing sockets the stuck loop still watched)
    (got, closed_by, closed), err1 = run_ranks(close_while_a_watchdog_sends, 2, store.port,
                                               transport, timeout=90)
    assert closed_by == ["MainThread"], closed_by
    assert closed and got in ("GroupBrokenError", "GroupClosedError"), got
    assert err1 == "PeerLostError", err1


def watchdog_task(rank, size, port, what, transport, op):
    """As watchdog, but the watchdog is another asyncio task of the waiting call's event loop
    (an engine's health check, say): the call must end then too, not at its next status
    probe, liveness check or deadline (it did not for abort(): 0.7-20 s later)."""
    name = f"wdtask-{what}-{transport}-{op}"
    g = _group(rank, size, port, name=name, transport=transport, liveness_timeout=None)
    g.barrier()
    if rank == 1:
        g.store.wait([f"{name} done"], timeout=60)
        return None

    async def main():
        call = asyncio.create_task(g.aio.all_reduce(1, timeout=30) if op == "all_reduce"
                                   else g.aio.recv(1, timeout=30))
        await asyncio.sleep(0.3)
        t = time.monotonic()
        g.abort("watchdog: step hung") if what == "abort" else g.close()
        try:
            await asyncio.wait_for(call, 20)
        except ctrlcomm.CtrlcommError as e:
            return type(e).__name__, str(e), time.monotonic() - t, g.closed, g.broken
        except asyncio.TimeoutError:
            return "still waiting 20 s after it"
        return "no error"

    err = asyncio.run(main())
    st = ctrlcomm.StoreClient("127.0.0.1", port, prefix=f"ctrlcomm/{name}/", timeout=30)
    st.set(f"{name} done", b"1")
    st.close()
    return err


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
@pytest.mark.parametrize("op", ["all_reduce", "recv"])
@pytest.mark.parametrize("what", ["abort", "close"])
def test_abort_or_close_from_another_task_ends_a_waiting_call_at_once(store, what, op,
                                                                       transport):
    got = run_ranks(watchdog_task, 2, store.port, what, transport, op)[0]
    assert isinstance(got, tuple), got
    name, msg, took, closed, broken = got
    assert took < 5.0, f"the call ended {took:.1f} s after the {what}"
    if what == "abort":
        assert name == "GroupBrokenError" and "watchdog: step hung" in msg and broken, msg
    else:
        assert name == "GroupClosedError" and closed, msg


def closed_from_a_thread_while_the_loop_is_busy(rank, size, port):
    """Rank 0's group waited through its event loop (the loop watches the group's epoll
    descriptor); another thread closes it (as the closer of a dropped group does) while the
    loop is busy. The descriptor's number must not be free before the loop has stopped
    watching it: an unrelated reader the loop then adds on a descriptor of that number was
    never called (the loop's late remove_reader removed it)."""
    g = _group(rank, size, port, name="busyloop")
    if rank == 1:
        time.sleep(0.5)  # rank 0 waits meanwhile, through its loop
        g.barrier()
        g.store.wait(["busyloop done"], timeout=60)
        return None

    async def main():
        loop = asyncio.get_running_loop()
        g._core.ep.spare_cpu = False  # (every wait through the loop)
        await g.aio.barrier()
        old = g._core.ep.fd
        t = threading.Thread(target=g.close)
        t.start()
        t.join()  # (the loop is busy meanwhile: the close's loop work waits)
        held, a = [], None
        for _ in range(20):  # the next descriptors: one may get the old number
            x, y = socket.socketpair()
            held += [x, y]
            if old in (x.fileno(), y.fileno()):
                a, b = (x, y) if x.fileno() == old else (y, x)
                break
        if a is None:
            a, b = held[-2], held[-1]
        fired = asyncio.Event()
        loop.add_reader(a, fired.set)
        b.send(b"x")
        try:
            await asyncio.wait_for(fired.wait(), 5)
            out = "fired"
        except asyncio.TimeoutError:
            out = f"the reader on descriptor {a.fileno()} (the group's was {old}) never fired"
        loop.remove_reader(a)
        for s in held:
            s.close()
        return out

    out = asyncio.run(main())
    st = ctrlcomm.StoreClient("127.0.0.1", port, prefix="ctrlcomm/busyloop/", timeout=30)
    st.set("busyloop done", b"1")
    st.close()
    return out


def test_a_close_from_another_thread_leaves_the_loops_other_readers_working(store):
    assert run_ranks(closed_from_a_thread_while_the_loop_is_busy, 2, store.port)[0] == "fired"


def test_liveness_default_comes_from_the_environment_also_for_the_seed_apis():
    from ctrlcomm._calls import _env_liveness

    assert _env_liveness(None) == 5.0 and _env_liveness("12.5") == 12.5
    assert _env_liveness("none") is None and _env_liveness("OFF") is None
    assert _env_liveness("soon") == 5.0 and _env_liveness("-3") == 5.0  # (warned)
    # read when ctrlcomm is imported: in a fresh process, a StatelessProcessGroup (which
    # takes no liveness argument) gets it
    code = ("import ctrlcomm, sys\n"
            "pg = ctrlcomm.StatelessProcessGroup.create('127.0.0.1', int(sys.argv[1]), 0, 1)\n"
            "print(pg._group._core.liveness_timeout)\n"
            "pg.close()\n")
    from ctrlcomm.testing import free_port

    for value, want in (("30", "30.0"), ("none", "None")):
        env = dict(os.environ, CTRLCOMM_LIVENESS_TIMEOUT=value)
        p = subprocess.run([sys.executable, "-c", code, str(free_port())], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.strip() == want, (p.stdout, p.stderr)


def test_a_close_asked_while_another_thread_takes_and_leaves_the_group_is_never_lost():
    # a thread keeps calling a broken group (each call takes the lock, finds the group broken
    # and leaves) while another closes it: whoever holds the lock when close() is asked
    # must do it on leaving (it was lost in 52 of 200 trials before that)
    from ctrlcomm.testing import free_port

    for i in range(60):
        g = ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, name=f"race{i}", timeout=5)
        g.abort("broken on purpose")
        stop = threading.Event()

        def hammer(g=g, stop=stop):
            while not stop.is_set():
                try:
                    g.barrier()
                except ctrlcomm.CtrlcommError:
                    pass

        t = threading.Thread(target=hammer)
        t.start()
        time.sleep(0.002)
        g.close()
        stop.set()
        t.join(10)
        assert g._core.ep.closed and not g._core._deferred, i


def closes_with_a_call_left_in_a_stopped_loop(rank, size, port):
    g = _group(rank, size, port, name="stopped-loop")
    g.barrier()
    if rank == 0:
        # an awaited recv left pending in a loop that no longer runs (not cancelled)
        loop = asyncio.new_event_loop()
        task = loop.create_task(g.aio.recv(1, timeout=60))
        loop.run_until_complete(asyncio.wait([task], timeout=0.2))
        g.close()
        closed = g._core.ep.closed
        time.sleep(3)  # alive, doing other work: the peer must learn of the close anyway
        return closed
    t = time.monotonic()
    try:
        g.recv(0, timeout=20)
    except ctrlcomm.PeerLostError as e:
        return str(e), time.monotonic() - t
    return "no error"


def test_close_takes_effect_even_if_a_call_holding_the_group_never_resumes(store):
    closed, (msg, took) = run_ranks(closes_with_a_call_left_in_a_stopped_loop, 2, store.port)
    assert closed and "closed the group" in msg and took < 2.5, (closed, msg, took)


@pytest.mark.parametrize("path", ["send_framed", "send_many"])  # small and general messages
def test_a_send_on_a_connection_the_peer_reset_reports_the_reset(path, monkeypatch):
    import struct

    from ctrlcomm.transport._tcp import TcpEndpoint

    monkeypatch.setenv("CTRLCOMM_LOCAL_SOCKETS", "0")  # plain TCP
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    lost = []
    ep = TcpEndpoint("127.0.0.1", on_lost=lambda r, why, certain: lost.append((r, why)))
    try:
        ep.set_peers({1: f"tcp://127.0.0.1:{srv.getsockname()[1]}"})

        def send():
            if path == "send_framed":
                ep.send_framed([1], [b"x" * 100])
            else:
                ep.send_many([1], [b"x" * 100])

        send()
        peer, _ = srv.accept()
        deadline = time.monotonic() + 5
        while ep.unflushed and time.monotonic() < deadline:  # connected, sent
            ep.wait(0.05)
            ep.drain(lambda m: None)
        assert peer.recv(1000)
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # a reset
        time.sleep(0.2)
        send()
        assert lost == [(1, "send failed: Connection reset by peer")]
    finally:
        ep.close()
        srv.close()


def send_to_a_rank_that_dies(rank, size, port):
    """Rank 1 never reads and is killed 1 s in; rank 0 sends it 1 MiB messages, more than
    the kernel's buffers hold, then, once it knows, one more; and sends to rank 2."""
    g = _group(rank, size, port)
    g.barrier()
    if rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    out = None
    if rank == 0:
        out = []
        for i in range(40):
            try:
                g.send(b"x" * (1 << 20), 1)
            except ctrlcomm.PeerLostError as e:
                out.append((i, e.ranks, str(e)))
                break
        try:
            g.send("once more", 1)
        except ctrlcomm.PeerLostError as e:
            out.append(("after", e.ranks, str(e)))
        g.send("to rank 2", 2)
    if rank == 2:
        out = g.recv(0)
    return out


def test_a_send_to_a_lost_rank_raises_naming_it_and_the_others_still_work(store):
    res = run_ranks(send_to_a_rank_that_dies, 3, store.port, may_die=(1,), timeout=60)
    assert res[2] == "to rank 2"
    (i, ranks, msg), (after, ranks2, msg2) = res[0]
    assert i < 40 and ranks == [1] and "send(dst=1" in msg and "rank 1" in msg, res[0]
    assert after == "after" and ranks2 == [1] and "rank 1" in msg2, res[0]


def _mark(port, what):
    """A file that one rank makes when it has seen what it waits for, so that the rank
    that stays alive for it (its exit would send what it queued) stops waiting."""
    return os.path.join(tempfile.gettempdir(), f"ctrlcomm-test-{port}-{what}")


def _clear_marks(port, *whats):
    for what in whats:
        try:
            os.unlink(_mark(port, what))
        except FileNotFoundError:
            pass


def _alive_until_marked(port, what, longest):
    path, end = _mark(port, what), time.monotonic() + longest
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def aborts_before_ever_sending(rank, size, port, transport, what):
    """Rank 1 has never sent anything to rank 0 when it aborts, and then makes no call (its
    process runs on). Rank 0 waits for it."""
    g = _group(rank, size, port, name="untold", transport=transport, timeout=5)
    if rank == 1:
        g.abort("watchdog fired")
        # (alive: at exit, what is queued goes out; until after rank 0's deadline at most)
        _alive_until_marked(port, "untold", 7)
        return None
    try:
        g.barrier() if what == "barrier" else g.recv(1)
    except ctrlcomm.CtrlcommError as e:
        return type(e).__name__, str(e), e.ranks if isinstance(e, ctrlcomm.PeerLostError) \
            else None
    finally:
        g.close()
        open(_mark(port, "untold"), "w").close()
    return "returned"


@pytest.mark.parametrize("what", ["barrier", "recv"])
def test_a_rank_that_aborts_before_it_ever_sent_still_tells_its_peers(store, what):
    # (before, over TCP: its word was queued on a connection still being made, and nothing
    # sent it while the rank made no call: rank 0 waited out its deadline)
    _clear_marks(store.port, "untold")
    try:
        kind, text, ranks = run_ranks(aborts_before_ever_sending, 2, store.port, "tcp",
                                      what)[0]
    finally:
        _clear_marks(store.port, "untold")
    assert kind == "PeerLostError" and ranks == [1] and "watchdog fired" in text, text


def sends_to_a_lost_peer(rank, size, port, transport, fault, op):
    """Rank 1 goes (killed, closed or aborted) without a word from rank 0; rank 0 then sends
    to it without waiting for anything: point to point, or a collective's step that only
    sends (a broadcast's root, a gather's leaf)."""
    g = _group(rank, size, port, name="sendonly", transport=transport, liveness_timeout=3.0,
               heartbeat_interval=0.25, timeout=20)
    g.barrier()
    if rank == 0:
        open(_mark(port, "sendonly-passed"), "w").close()
    if rank == 1:
        # (not before rank 0 has passed the barrier: over ZeroMQ, a message this rank's
        # barrier queued may not have left its I/O thread yet when SIGKILL ends the process;
        # rank 0 then waited for it and found rank 1 lost at the barrier, in a loaded run)
        _alive_until_marked(port, "sendonly-passed", 20)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        getattr(g, fault)()
        _alive_until_marked(port, "sendonly", 12)
        return None
    calls = {"send": lambda i: g.send(i, dst=1),
             "broadcast": lambda i: g.broadcast(i, src=0),
             "gather": lambda i: g.gather(i, dst=1)}
    t = time.monotonic()
    n = 0
    try:
        while time.monotonic() - t < 10:
            calls[op](n)
            n += 1
            time.sleep(0.01)
    except ctrlcomm.PeerLostError as e:
        return e.ranks, n
    finally:
        g.close()
        open(_mark(port, "sendonly"), "w").close()
    return "no error", n


@pytest.mark.parametrize(("transport", "fault", "op"), [
    ("zmq", "kill", "send"), ("zmq", "close", "send"), ("zmq", "abort", "broadcast"),
    ("tcp", "abort", "broadcast"), ("tcp", "close", "gather"), ("tcp", "kill", "gather"),
])
def test_a_send_that_does_not_wait_finds_its_peer_lost(store, transport, fault, op):
    # (before: over ZeroMQ a send never failed, 1,400 of them in 15 s to a killed peer; a
    # broadcast's root, a gather's leaf returned, call after call, with the peer's abort
    # or goodbye unread in its socket)
    _clear_marks(store.port, "sendonly", "sendonly-passed")
    try:
        ranks, n = run_ranks(sends_to_a_lost_peer, 2, store.port, transport, fault, op,
                             may_die=(1,), timeout=60)[0]
    finally:
        _clear_marks(store.port, "sendonly", "sendonly-passed")
    assert ranks == [1], (ranks, n)


def cancelled_first_call(rank, size, port):
    """Rank 0, the star's root, has its first call (an awaited all_reduce) cancelled before
    it ever sent to the others, who come late; then it makes no call."""
    g = _group(rank, size, port, name="cancelled", timeout=5)
    if rank == 0:
        async def first():
            try:
                await asyncio.wait_for(g.aio.all_reduce(1), 0.5)
            except asyncio.TimeoutError:
                pass
        asyncio.run(first())
        # (alive: at exit, what is queued goes out; until after the others' deadline at most)
        _alive_until_marked(port, "cancelled-1", 7)
        _alive_until_marked(port, "cancelled-2", 7)
        return None
    time.sleep(1.0)
    try:
        g.all_reduce(1)
    except ctrlcomm.CtrlcommError as e:
        return type(e).__name__, e.ranks if isinstance(e, ctrlcomm.PeerLostError) else None
    finally:
        g.close()
        open(_mark(port, f"cancelled-{rank}"), "w").close()
    return "returned"


def test_a_call_cancelled_before_it_sent_still_tells_the_others(store, monkeypatch):
    # (before: the word was queued on connections still being made, over TCP, and sent at
    # the rank's next call or exit: the others waited out their deadline. Across hosts every
    # connect is so; here, loopback TCP without the local sockets)
    monkeypatch.setenv("CTRLCOMM_LOCAL_SOCKETS", "0")
    _clear_marks(store.port, "cancelled-1", "cancelled-2")
    try:
        res = run_ranks(cancelled_first_call, 3, store.port, timeout=60)
    finally:
        _clear_marks(store.port, "cancelled-1", "cancelled-2")
    assert res[1:] == [("PeerLostError", [0])] * 2, res


def bound_everywhere(rank, size, port):
    g = _group(rank, size, port, name="anyif", bind_host="0.0.0.0")  # (warns: no key)
    out = g.all_gather(rank), g._core.ep.peers
    g.close()
    return out


def test_a_rank_bound_to_every_interface_tells_its_peers_a_reachable_address(store,
                                                                          monkeypatch):
    # (before: it published tcp://0.0.0.0:PORT, which sends a peer on another host to its
    # own; the interface that reaches the store is published instead)
    monkeypatch.setenv("CTRLCOMM_LOCAL_SOCKETS", "0")
    for got, peers in run_ranks(bound_everywhere, 2, store.port):
        assert got == [0, 1]
        assert all(a.startswith("tcp://127.0.0.1:") for a in peers.values()), peers


# ------------------------------------------------ signal handlers and threads (helper-46)


def closed_by_a_signal_handler(g, refused_first, awaited):
    """Rank 0 waits in a recv (blocking or awaited); a SIGALRM handler closes the group at
    0.5 s. ``refused_first``: another thread's barrier was refused (ConcurrentUseError)
    before. Rank 1 stays until rank 0 is done."""
    if g.rank == 1:
        g.store.wait(["test/done"], timeout=30)
        return None
    signal.signal(signal.SIGALRM, lambda *a: g.close())
    if refused_first:
        def other():
            time.sleep(0.2)
            try:
                g.barrier()
            except ctrlcomm.ConcurrentUseError:
                pass
        threading.Thread(target=other).start()
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t = time.monotonic()
    try:
        if awaited:
            asyncio.run(g.aio.recv(1, timeout=10))
        else:
            g.recv(1, timeout=10)
    except BaseException as e:  # noqa: BLE001
        out = type(e).__name__, time.monotonic() - t
    ctrlcomm.StoreClient("127.0.0.1", g.store.port, prefix=g.store.prefix).set("test/done", "1")
    return out


@pytest.mark.parametrize(("refused_first", "awaited"), [(True, False), (False, True)],
                         ids=["blocking-after-a-refused-call", "awaited"])
def test_a_close_from_a_signal_handler_ends_the_waiting_call_at_once(refused_first, awaited):
    """(Before: after another thread's call was refused, the refusal had cleared the flag
    saying a blocking call holds the group: the handler closed the sockets under its poll,
    which raised OSError (bad file descriptor). Awaited: the waiting task was woken with a
    plain set_result, which does not wake the loop's selector: it slept until its timer,
    3.5 s later.)"""
    kind, took = run_group(closed_by_a_signal_handler, 2, refused_first, awaited,
                           timeout=60)[0]
    assert kind == "GroupClosedError" and took < 2.5, (kind, took)


class _Alarm(Exception):
    pass


def interrupted_by_other_than_ctrl_c(g, kind):
    """Rank 0's all_reduce is interrupted by ``kind`` raised from a signal handler (the
    signal.alarm timeout idiom, a SIGTERM handler's sys.exit); it goes on, without closing,
    until rank 1 is done. Rank 1 comes to that all_reduce after it, with a 20 s deadline."""
    if g.rank == 1:
        time.sleep(1.5)  # (rank 0 waits in the call meanwhile, its part sent)
        t = time.monotonic()
        try:
            g.all_reduce(1, timeout=20)
            out = "returned"
        except ctrlcomm.PeerLostError as e:
            out = (str(e), time.monotonic() - t)
        g.store.set("test/done", "1")
        return out

    def alarm(*a):
        raise {"exit": SystemExit, "user": _Alarm}[kind]("alarm")

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        g.all_reduce(1, timeout=30)
    except (SystemExit, _Alarm):
        pass
    g.store.wait(["test/done"], timeout=40)
    return g.broken


@pytest.mark.parametrize("kind", ["exit", "user"])
def test_a_collective_ended_by_another_exception_than_ctrl_c_tells_the_others(kind):
    """(Before: only Ctrl-C told them; a SystemExit or an error from a signal handler broke
    the group here only, and the others waited out their deadlines.)"""
    broken, (text, took) = run_group(interrupted_by_other_than_ctrl_c, 2, kind, timeout=60)
    assert broken
    name = {"exit": "SystemExit", "user": "_Alarm"}[kind]
    assert f"interrupted on rank 0 ({name}: alarm)" in text and took < 10, (text, took)


def test_a_group_dropped_without_close_goes_with_its_last_reference():
    """(Before: its asyncio view held it back in a cycle: it waited for the cycle
    collector, its heartbeats going on and its peers not told, for as long as that took.)"""
    import gc
    import weakref

    from ctrlcomm.testing import free_port

    gc.disable()
    try:
        g = ctrlcomm.Group.create("127.0.0.1", free_port(), 0, 1, timeout=10)
        core = g._core
        asyncio.run(g.aio.barrier())  # (its view made and used; the view keeps the group,
        ref = weakref.ref(g)  # not the group its view)
        del g
        assert ref() is None
        deadline = time.monotonic() + 10  # (closed by a thread of its own, at once)
        while core.state != "closed" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.state == "closed"
    finally:
        gc.enable()


def root_whose_receiver_leaves(rank, size, port, fault):
    """Rank 0 broadcasts back to back (a step that only sends); rank 2 aborts (or closes)
    after 300 of them, and rank 1 receives until it learns of that."""
    g = _group(rank, size, port, name=f"leaves-{fault}", timeout=20)
    g.barrier()
    try:
        for i in range(10**9):
            if rank == 2 and i == 300:
                if fault == "abort":
                    g.abort("CUDA out of memory on rank 2")
                g.close()
                return None
            g.broadcast(i if rank == 0 else None, src=0)
    except ctrlcomm.PeerLostError as e:
        return e.ranks, str(e)
    finally:
        g.close()


@pytest.mark.parametrize("fault", ["abort", "close"])
def test_a_root_whose_receiver_aborts_or_closes_says_so_not_that_it_died(store, fault):
    # (found in review: over TCP the root's send to the rank that had left failed (broken
    # pipe) and it raised at once "rank 2 is gone (send failed...; its process died or exited
    # without close())", in 6 of 8 runs, with the abort's reason unread in the other stream;
    # and said rank 1 "died" too, which had only closed after raising)
    for _ in range(3):  # (the send failure came first in most runs, not all)
        got = run_ranks(root_whose_receiver_leaves, 3, store.port, fault, timeout=60)
        ranks, text = got[0]
        # (rank 1, told of the abort, may have closed by then: its goodbye says why)
        assert ranks in ([2], [1, 2]), got
        said = "rank 2 aborted the group: CUDA out of memory on rank 2" if fault == "abort" \
            else "rank 2 closed the group"
        assert said in text and "died" not in text, text
        # (rank 1 learns it from rank 2, or from rank 0's goodbye, which says why)
        assert got[1][0] in ([2], [0]) and "rank 2 " in got[1][1], got
