"""Progress without calls: what a send or broadcast left queued as it returned reaches its
peers while the sender makes no call (a rank that sends and then sleeps, or computes, for
longer than its peers' deadline), over every transport."""

import time

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks

MIB = 1 << 20


def sends_then_sleeps(rank, size, port, transport, op):
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="progress", timeout=60,
                               transport=transport) as g:
        g.barrier()
        if rank == 0:
            data = bytes(range(256)) * (64 * MIB // 256)
            if op == "send":
                for d in range(1, size):
                    g.send(data, dst=d)
            else:
                g.broadcast(data, src=0)
            time.sleep(6)  # no call: the receivers' deadline (4 s) passes meanwhile
            g.barrier()
            return None
        # (their deadline runs from the root's return on: they wait there already)
        got = g.recv(src=0, timeout=4) if op == "send" else g.broadcast(None, src=0, timeout=4)
        g.barrier()
        return len(got), got[:256] == bytes(range(256)), got[-1]


@pytest.mark.parametrize("op", ["send", "broadcast"])
@pytest.mark.parametrize("transport", ["shm", "tcp", "zmq"])
def test_what_a_send_left_queued_arrives_while_the_sender_makes_no_call(transport, op):
    res = run_ranks(sends_then_sleeps, 3, free_port(), transport, op, timeout=120)
    assert res[1:] == [(64 * MIB, True, 255)] * 2
