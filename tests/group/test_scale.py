"""256 ranks, one process each, on this machine: they form, and barrier, all_gather and
all_reduce give the right results."""

import pytest

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks


def big(rank, size, port):
    # (liveness checks off: 256 processes on two CPUs keep a heartbeat thread from running
    # for longer than the default 5 s; every peer's heartbeats cost each rank CPU too)
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="w256", timeout=300,
                               liveness_timeout=None) as g:
        g.barrier()
        gathered = g.all_gather(rank)
        total = g.all_reduce(rank)
        biggest = g.all_reduce(rank, op="max")
        g.barrier()
        return gathered == list(range(size)), total, biggest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_256_ranks_form_and_run_collectives():
    n = 256
    res = run_ranks(big, n, free_port(), timeout=500)
    assert res == [(True, n * (n - 1) // 2, n - 1)] * n
