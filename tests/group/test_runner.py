"""ctrlcomm.testing.run_ranks: results, failures, and a run that ends at its first failure."""

import sys
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


def sigint_state(rank, size):
    """Whether the rank ignores SIGINT, and whether it has it blocked, after a while."""
    import signal

    time.sleep(0.5)
    return (signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
            signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_that_ignore_sigint_ignore_it_from_their_start():
    """With ignore_sigint a rank ignores SIGINT from the moment it exists: a SIGINT sent to
    each rank as soon as it appears (in Python's start-up) neither ends it nor prints a
    traceback, and the rank ends up ignoring SIGINT, unblocked."""
    import os
    import signal
    import threading

    me, hit, stop = os.getpid(), set(), threading.Event()

    def interrupt_each_new_rank():
        while not stop.is_set():
            for d in os.listdir("/proc"):
                if not d.isdigit() or int(d) in hit:
                    continue
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        ours = ppid == me and b"spawn_main" in f.read()
                except (OSError, ValueError, IndexError):
                    continue
                if ours:  # a rank this test started
                    os.kill(int(d), signal.SIGINT)
                    hit.add(int(d))

    th = threading.Thread(target=interrupt_each_new_rank, daemon=True)
    th.start()
    try:
        out = run_ranks(sigint_state, 3, ignore_sigint=True, timeout=60)
    finally:
        stop.set()
        th.join()
    assert len(hit) == 3, hit
    assert out == [(True, False)] * 3


def parent_and_algo(rank, size):
    import os

    from ctrlcomm import _algo

    return os.getppid(), _algo.OVERRIDES, os.environ.get("CTRLCOMM_ALGO")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork server")
def test_ranks_start_from_a_fork_server_unless_the_environment_changed(monkeypatch):
    """By default ranks are forks of a server that has imported ctrlcomm (a fraction of a
    spawned process's start); where the environment differs from the server's, spawned:
    a variable ctrlcomm reads at import (CTRLCOMM_ALGO) takes effect in the ranks."""
    import os
    from multiprocessing import forkserver

    from ctrlcomm.testing import _runner

    if _runner._server["pid"] is None and forkserver._forkserver._forkserver_pid is not None:
        pytest.skip("a fork server started by other code runs (by a test run before, alone)")
    monkeypatch.delenv("CTRLCOMM_ALGO", raising=False)
    out = run_ranks(parent_and_algo, 2, timeout=60)
    server = out[0][0]
    assert server != os.getpid() and [o[0] for o in out] == [server] * 2, out
    assert out[0][1:] == ({}, None)
    assert run_ranks(parent_and_algo, 2, timeout=60)[0][0] == server  # (the same server)
    monkeypatch.setenv("CTRLCOMM_ALGO", "all_reduce=doubling")
    out = run_ranks(parent_and_algo, 2, timeout=60)
    assert out == [(os.getpid(), {"all_reduce": "doubling"}, "all_reduce=doubling")] * 2
    monkeypatch.delenv("CTRLCOMM_ALGO")
    assert run_ranks(parent_and_algo, 2, timeout=60)[0][0] == server
