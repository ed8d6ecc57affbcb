"""A same-host peer's exit is seen through its process descriptor, over every transport:
with heartbeats off (liveness_timeout=None) and no connection to tell it, the survivors
still name the rank gone; a stopped one is not taken for gone."""

import os
import signal
import time

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks


def waits_for_the_dead(rank, size, port, transport):
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="exit", timeout=30,
                               transport=transport, liveness_timeout=None) as g:
        g.barrier()
        if rank == 2:
            time.sleep(0.3)  # (the others wait in their recv meanwhile)
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.monotonic()
        try:
            g.recv(src=2, timeout=25)  # (ZeroMQ reconnects silently: only its exit tells)
        except ctrlcomm.PeerLostError as e:
            return e.ranks, str(e), time.monotonic() - t
        return None


@pytest.mark.parametrize("transport", ["shm", "tcp", "zmq"])
def test_a_killed_peer_that_never_sent_is_named_gone_without_heartbeats(transport):
    res = run_ranks(waits_for_the_dead, 3, free_port(), transport, may_die=(2,))
    for out in res[:2]:
        ranks, text, took = out
        assert ranks == [2], out
        # (a connection that rank 2 made, as the barrier's, may end first and tell it)
        assert "rank 2 is gone (its process exited" in text or (
            transport != "zmq" and "rank 2 is gone (connection closed" in text), text
        assert took < 20, out  # (not the recv's deadline)


def stopped(rank, size, port, transport):
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="stop", timeout=30,
                               transport=transport, liveness_timeout=None) as g:
        pids = g.all_gather(os.getpid())
        if rank == 0:
            os.kill(pids[1], signal.SIGSTOP)
            try:
                g.recv(src=1, timeout=1.0)
            except ctrlcomm.PeerLostError as e:
                got = f"lost: {e}"
            except ctrlcomm.CtrlcommError as e:
                got = type(e).__name__
            finally:
                os.kill(pids[1], signal.SIGCONT)
            g.send("go on", dst=1)
            return got
        return g.recv(src=0)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_stopped_peer_is_waited_for_not_taken_for_gone(transport):
    got, other = run_ranks(stopped, 2, free_port(), transport)
    assert got == "PointToPointTimeoutError" or got.endswith("TimeoutError"), got
    assert other == "go on"
