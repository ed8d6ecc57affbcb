"""``ctrlcomm run -n N [--host H] [--port P] -- COMMAND...``: start N processes of a command on
this host, as ``mpiexec`` and ``torchrun`` do, each with the ``CTRLCOMM_*`` variables that
``Group.from_env()`` reads; each line they print prefixed with their rank; Ctrl-C passed on
to them; the exit status the first rank that failed had.

Each rank runs in a session (and process group) of its own, so that a terminal's Ctrl-C reaches the
launcher only, which passes it on once (else every rank would get it twice, or, started by
a shell without job control, not at all)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

GRACE_S = 3.0  # after the first failure, how long the other ranks may take to end of themselves
KILL_S = 5.0  # after a SIGTERM (or a passed-on Ctrl-C), how long before SIGKILL


def _pump(rank: int, stream: IO[bytes], out: Any, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed with ``[rank]``."""
    prefix = f"[{rank}] ".encode()
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def _status(code: int) -> int:
    """A child's exit status as a shell reports it (128 + the signal that ended it)."""
    return 128 - code if code < 0 else code


def run(args: argparse.Namespace) -> int:
    from .testing import free_port

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("ctrlcomm run: give the command after --, e.g. ctrlcomm run -n 4 -- python "
              "train.py", file=sys.stderr)
        return 2
    host = args.host
    port = args.port if args.port is not None else free_port(host)
    procs: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()
    pumps = []
    stopping: list[int] = []  # the signal being passed on, once
    old = {}

    def on_signal(signum: int, frame: Any) -> None:
        if not stopping:
            stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except OSError:
                    pass

    # (SIGHUP too: the terminal or ssh session closed; the ranks, in sessions of their own,
    # would not get it)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, on_signal)
    try:
        for rank in range(args.n):
            if stopping:  # (stopped while starting: start no more)
                break
            env = {**os.environ, "CTRLCOMM_HOST": host, "CTRLCOMM_PORT": str(port),
                   "CTRLCOMM_RANK": str(rank), "CTRLCOMM_WORLD_SIZE": str(args.n),
                   "PYTHONUNBUFFERED": "1"}
            try:
                p = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
            except OSError as e:
                print(f"ctrlcomm run: cannot start {command[0]!r}: {e.strerror or e}",
                      file=sys.stderr)
                on_signal(signal.SIGTERM, None)
                _reap(procs)
                return 127
            procs.append(p)
            for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_pump, args=(rank, stream, out, lock), daemon=True)
                t.start()
                pumps.append(t)
        status = _wait(procs, stopping, on_signal)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    for t in pumps:
        t.join(5)
    return status


def _wait(procs: list[subprocess.Popen[bytes]], stopping: list[int], stop: Any) -> int:
    """Wait for every rank; the status of the first that failed (0 if none did). After a
    failure the others have GRACE_S to end, then get SIGTERM; after a signal passed on,
    KILL_S, then SIGKILL."""
    first: int | None = None
    failed_at = kill_at = None
    while True:
        running = [p for p in procs if p.poll() is None]
        for p in procs:
            if p.returncode not in (None, 0) and first is None:
                first = _status(p.returncode)
                failed_at = time.monotonic()
        if not running:
            break
        now = time.monotonic()
        if stopping and kill_at is None:
            kill_at = now + KILL_S
        if failed_at is not None and kill_at is None and now > failed_at + GRACE_S:
            stop(signal.SIGTERM, None)
            kill_at = now + KILL_S
        if kill_at is not None and now > kill_at:
            for p in running:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.05)
    if first is None and stopping:
        return 128 + stopping[0]
    return first or 0


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        try:
            p.wait(KILL_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()


def add_run_parser(sub: Any) -> None:
    from .bench._cli import _int_in, _port_from

    r = sub.add_parser("run", help="start N ranks of a command on this host (as mpiexec)",
                       description=__doc__)
    r.add_argument("-n", type=_int_in(1), required=True, help="the number of ranks")
    r.add_argument("--host", default="127.0.0.1",
                   help="the address rank 0 serves the store on (default 127.0.0.1)")
    r.add_argument("--port", type=_port_from(1), help="the store's port (default: a free one)")
    r.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command, after --: each rank runs it")
    r.set_defaults(func=run)
