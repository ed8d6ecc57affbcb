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

    from ctrlcomm.testing import _runner

    if not _runner._fork_server():
        pytest.skip("no fork server of run_ranks can stand for spawn here (one started by "
                    "other code, or the environment changed since it started)")
    before = os.environ.get("CTRLCOMM_ALGO")
    out = run_ranks(parent_and_algo, 2, timeout=60)
    server = out[0][0]
    assert server != os.getpid() and [o[0] for o in out] == [server] * 2, out
    assert out[0][2] == before
    new = "all_reduce=doubling" if before != "all_reduce=doubling" else "all_reduce=flat"
    monkeypatch.setenv("CTRLCOMM_ALGO", new)
    out = run_ranks(parent_and_algo, 2, timeout=60)
    assert out == [(os.getpid(), {"all_reduce": new.split("=")[1]}, new)] * 2
    monkeypatch.undo()
    assert run_ranks(parent_and_algo, 2, timeout=60)[0][0] == server


def prints(rank, size):
    import sys

    # (a line in one write: the ranks share the file, and print's pieces interleave where
    # Python runs unbuffered, PYTHONUNBUFFERED=1: 'out of rank 0out of rank 1')
    sys.stdout.write(f"out of rank {rank}\n")
    sys.stdout.flush()
    sys.stderr.write(f"err of rank {rank}\n")
    sys.stderr.flush()
    return rank


def test_what_a_rank_prints_goes_where_this_process_prints_now(capfd):
    # (a fork server's child has the server's standard output and error: those of the
    # process that started it, as they were then; pytest's capfd points them elsewhere)
    assert run_ranks(prints, 2, timeout=60) == [0, 1]
    out, err = capfd.readouterr()
    assert sorted(out.split("\n")) == ["", "out of rank 0", "out of rank 1"], out
    assert sorted(err.split("\n")) == ["", "err of rank 0", "err of rank 1"], err


def _script(tmp_path, text, timeout=120):
    import subprocess

    (tmp_path / "script.py").write_text(text)
    return subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


_RANKS = """
import os, sys, time
from ctrlcomm.testing import run_ranks

def pid(rank, size):
    return os.getpid()

def sleeper(rank, size, path):
    with open(f"{path}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_ranks_end_with_a_runner_that_is_killed(tmp_path):
    # (every child of a fork server inherits its "alive" pipe: while ranks held it, the
    # server outlived a runner killed with SIGKILL, and so did they)
    import os
    import signal
    import subprocess

    (tmp_path / "script.py").write_text(_RANKS + """
if __name__ == "__main__":
    print(run_ranks(pid, 1) != [os.getpid()], flush=True)  # (the server started)
    run_ranks(sleeper, 2, sys.argv[1], timeout=300)
""")
    runner = subprocess.Popen([sys.executable, "script.py", str(tmp_path / "pid")],
                              cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout.readline().strip() == "True"
        end = time.monotonic() + 60
        while not all((tmp_path / f"pid.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < end and runner.poll() is None
            time.sleep(0.05)
        time.sleep(0.2)
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in (0, 1)]
    finally:
        runner.kill()
        runner.wait(30)
        runner.stdout.close()
    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    end, alive = time.monotonic() + 10, pids
    while alive and time.monotonic() < end:
        time.sleep(0.1)
        alive = [p for p in pids if running(p)]
    for p in alive:  # (ranks of this test's runner: ended here, so that nothing is left)
        os.kill(p, signal.SIGKILL)
    assert not alive, "ranks outlived their runner"


def test_a_fork_of_a_runner_runs_ranks_too(tmp_path):
    # (the fork has the runner's record of its server, which is not its child: it asked
    # after it and raised ChildProcessError)
    done = _script(tmp_path, _RANKS + """
if __name__ == "__main__":
    first = run_ranks(pid, 2)
    child = os.fork()
    if child == 0:
        try:
            ok = len(set(run_ranks(pid, 2)) - set(first)) == 2
        except BaseException as e:
            print(type(e).__name__, e, flush=True)
            ok = False
        os._exit(0 if ok else 3)
    print("fork", os.waitpid(child, 0)[1] >> 8, "again", len(run_ranks(pid, 2)), flush=True)
""")
    assert done.stdout.split() == ["fork", "0", "again", "2"], (done.stdout, done.stderr)


def test_a_preload_of_the_callers_that_fails_leaves_ranks_spawned(tmp_path):
    # (the server ended at its start, and run_ranks raised a bare EOFError)
    (tmp_path / "fragile.py").write_text("raise RuntimeError('not here')\n")
    done = _script(tmp_path, _RANKS + """
import multiprocessing
if __name__ == "__main__":
    multiprocessing.set_forkserver_preload(["fragile"])
    print(len(run_ranks(pid, 2)), len(run_ranks(pid, 3)), flush=True)
""")
    assert done.stdout.split() == ["2", "3"], (done.stdout, done.stderr)


def test_a_rank_that_ends_just_before_it_is_killed_is_no_error():
    # (CI: run_ranks saw a rank alive, the rank ended and the fork server reaped it, and the
    # kill that followed raised ProcessLookupError out of the test)
    import multiprocessing
    import os
    from multiprocessing.connection import wait

    from ctrlcomm.testing._runner import _fork_server

    assert _fork_server()
    p = multiprocessing.get_context("forkserver").Process(target=os._exit, args=(0,))
    p.start()
    try:
        # ended, and reaped by the server (it says so after waitpid), but not polled here:
        # to the Process object it may still be running
        assert wait([p.sentinel], timeout=30), "the process did not end"
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)
        p.kill()  # (as run_ranks kills; it was os.kill(p.pid, SIGKILL), which raised here)
    finally:
        p.join(10)
    assert p.exitcode == 0
