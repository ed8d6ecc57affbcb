"""`ctrlcomm run`: ranks started with the variables Group.from_env reads, their lines prefixed,
the first failure's status, Ctrl-C passed on: real processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from ctrlcomm.testing import free_port

FORM = """
import os, sys, time
import ctrlcomm
g = ctrlcomm.Group.from_env(timeout=30)
"""


def launch(tmp_path, body, *opts, n=3):
    script = tmp_path / "rank.py"
    script.write_text(FORM + textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "ctrlcomm", "run", "-n", str(n), *opts, "--",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)


def test_ranks_form_from_the_environment_and_their_lines_are_prefixed(tmp_path):
    port = free_port()
    p = launch(tmp_path, """
        print("sum", g.all_reduce(g.rank), os.environ["CTRLCOMM_PORT"])
        print("to stderr", g.rank, file=sys.stderr)
        g.close()
    """, "--port", str(port), n=4)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == [f"[{r}] sum 6 {port}" for r in range(4)]
    assert sorted(p.stderr.splitlines()) == [f"[{r}] to stderr {r}" for r in range(4)]


def test_the_first_failing_rank_sets_the_exit_status_and_the_rest_end(tmp_path):
    t = time.monotonic()
    p = launch(tmp_path, """
        g.barrier()
        if g.rank == 1:
            os._exit(3)
        time.sleep(60)  # (ended by the launcher, after its grace)
    """)
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert time.monotonic() - t < 30


def test_ctrl_c_is_passed_on_and_no_rank_is_left(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(FORM + textwrap.dedent("""
        g.barrier()
        print("ready", os.getpid(), flush=True)
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(5)
    """))
    p = subprocess.Popen([sys.executable, "-m", "ctrlcomm", "run", "-n", "2", "--",
                          sys.executable, str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        while len(pids) < 2:
            line = p.stdout.readline()
            assert line, p.stderr.read()
            if " ready " in line:
                pids.append(int(line.split()[-1]))
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert out.count("interrupted") == 2, (out, err)
    assert p.returncode == 5  # (the ranks' own status: they failed, on the Ctrl-C)
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"rank process {pid} still runs")


def test_bad_commands_are_refused():
    p = subprocess.run([sys.executable, "-m", "ctrlcomm", "run", "-n", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "give the command after --" in p.stderr
    p = subprocess.run([sys.executable, "-m", "ctrlcomm", "run", "-n", "2", "--",
                        "/nonexistent/command"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 127 and "cannot start" in p.stderr
    p = subprocess.run([sys.executable, "-m", "ctrlcomm", "--version"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("ctrlcomm ")
