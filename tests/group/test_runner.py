"""ctrlcomm.testing.run_ranks: results, failures, and a run that ends at its first failure."""

import time

import pytest

from ctrlcomm.testing import RankFailedError, run_ranks


def rank0_fails_rank1_waits(rank, size):
    if rank == 0:
        raise RuntimeError("cannot bind")
    time.sleep(60)  # as a rank waiting for rank 0 would
    return "done"


def test_fail_fast_stops_the_others_at_the_first_failure():
    t = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        run_ranks(rank0_fails_rank1_waits, 2, timeout=50, fail_fast=True)
    assert time.monotonic() - t < 20  # not the 60 s rank 1 sleeps, nor the 50 s timeout
    assert "RuntimeError: cannot bind" in e.value.failures[0]
    assert e.value.failures[1] == "stopped: rank 0 failed first"


def sleeps_then_returns(rank, size):
    time.sleep(0.5 * rank)
    return rank * 10


def test_results_in_rank_order_and_a_failure_without_fail_fast_waits_for_the_rest():
    assert run_ranks(sleeps_then_returns, 3, fail_fast=True) == [0, 10, 20]
    t = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        run_ranks(rank0_fails_rank1_waits, 2, timeout=3)
    assert time.monotonic() - t >= 3  # waited for rank 1 until the timeout
    assert "RuntimeError: cannot bind" in e.value.failures[0]
    assert "still running after 3 s" in e.value.failures[1]


def parent_and_sigint(rank, size):
    """The rank's parent, and whether it ignores SIGINT."""
    import os
    import signal

    return os.getppid(), signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_are_plain_processes_under_each_start_method(method):
    """Under spawn a rank's parent is this process (a rank dies with it); under forkserver
    it is the server, and the rank still runs. Neither ignores SIGINT unless any new Python
    process here would (a shell's background job inherits it ignored)."""
    import os
    import subprocess
    import sys

    fresh = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal("
                            "signal.SIGINT) is signal.SIG_IGN)"], capture_output=True,
                           text=True, timeout=60).stdout.strip() == "True"
    out = run_ranks(parent_and_sigint, 2, start_method=method, timeout=60)
    assert [ignored for _, ignored in out] == [fresh] * 2
    if method == "spawn":
        assert [ppid for ppid, _ in out] == [os.getpid()] * 2
