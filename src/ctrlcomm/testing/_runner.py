"""Run a function in N real processes, one per rank, and collect the results."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any


class RankFailedError(AssertionError):
    """One or more ranks raised, crashed or did not finish in time."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


def _ephemeral_range() -> tuple[int, int]:
    """The range of ports the kernel hands out for outgoing connections ((0, 0) where it
    cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 0, 0


# ports a test's store must not take though free: Kubernetes' NodePort range (a node's
# iptables may send them elsewhere) and torch's default MASTER_PORT
_AVOID = (range(30000, 32768), range(29400, 29600))
_pick = random.SystemRandom()  # (not the random module's state: tests may seed it)


def _candidates(low: int, high: int) -> list[range]:
    """Where to look for a port outside the ephemeral range ``(low, high)``: below it from
    10000, and above it, each where there are at least 1000 ports."""
    out = []
    if low > 11000:
        out.append(range(10000, low))
    if 0 < high < 64535:
        out.append(range(high + 1, 65536))
    return out


def _random_port(spans: list[range]) -> int:
    return _pick.choice(_pick.choice(spans))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a group's rendezvous store.

    Taken at random outside the kernel's ephemeral range (checked by binding it): a port
    the OS hands out when asked for port 0 comes from that range, from which every
    process's outgoing connections also take their source ports, at any moment, so it may
    be gone by the time rank 0 binds it; outside the range only an explicit bind can take
    it. Where the range cannot be read or leaves no room, a port the OS hands out."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    spans = _candidates(*_ephemeral_range())
    for _ in range(100 if spans else 0):
        port = _random_port(spans)
        if any(port in r for r in _AVOID):
            continue
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise  # not a matter of this port (a host that is not local, say)
        return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tie_to_parent(parent: int) -> None:
    """End this process when its parent ends (Linux: PR_SET_PDEATHSIG), so that ranks never
    outlive a runner killed before its cleanup ran (SIGKILL, say)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # it ended before that
        os._exit(1)


@contextlib.contextmanager
def _sigint_held(hold: bool) -> Iterator[None]:
    """With ``hold``: SIGINT is blocked in this thread (a process started here inherits the
    mask, across exec), and, in the main thread, a Ctrl-C meanwhile is raised only at the
    end (another thread may take the signal: Python then raises it in the main thread at
    once, in the middle of a process's start)."""
    if not hold:
        yield
        return
    got: list[int] = []
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if old is not None:
            signal.signal(signal.SIGINT, old)
            if got:
                signal.raise_signal(signal.SIGINT)  # as it would have been, had it waited


def _child(fn: Callable[..., Any], rank: int, size: int, args: tuple[Any, ...],
           kwargs: dict[str, Any], q: Any, parent: int | None = None,
           ignore_sigint: bool = False) -> None:
    if ignore_sigint:  # (blocked since the fork: a Ctrl-C meanwhile is dropped here)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if parent is not None:
        _tie_to_parent(parent)
    try:
        out = fn(rank, size, *args, **kwargs)
    except BaseException as e:
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    try:
        q.put((rank, True, out))
    except Exception as e:  # unpicklable result
        q.put((rank, False, f"result not picklable: {e}"))


# the fork server ranks start from by default, where it can stand for spawn: its pid and the
# environment it started with
_server: dict[str, Any] = {"pid": None, "env": None}
_server_lock = threading.Lock()
_ENV_IGNORED = frozenset({"PYTEST_CURRENT_TEST"})  # (pytest's, set anew for each test)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _ENV_IGNORED}


def _fork_server() -> int | None:
    """The pid of a fork server preloaded with ctrlcomm, started by this module, running
    with the environment this process has now, whose forks can stand for spawned processes
    (a fresh interpreter's start and ctrlcomm's import, 0.3-0.8 s per rank here, saved); or
    None where there is none: no fork server on this platform, one started before by other
    code (its preloads and environment unknown), or an environment changed since it started
    (ctrlcomm reads some variables when imported: a rank must see them as set now)."""
    if "forkserver" not in mp.get_all_start_methods():
        return None
    from multiprocessing import forkserver

    fs = getattr(forkserver, "_forkserver", None)
    if not hasattr(fs, "_forkserver_pid") or not hasattr(fs, "_preload_modules"):
        return None  # (another Python's multiprocessing: spawn)
    env = _env()
    with _server_lock:
        if _server["pid"] is None:
            if fs._forkserver_pid is not None:  # type: ignore[union-attr]
                return None
            preload = list(fs._preload_modules or [])  # type: ignore[union-attr]
            forkserver.set_forkserver_preload(preload + ["ctrlcomm", "ctrlcomm.testing"])
        forkserver.ensure_running()  # (started, or started again where it died)
        pid = fs._forkserver_pid  # type: ignore[union-attr]
        if pid != _server["pid"]:
            _server.update(pid=pid, env=env)
        return int(pid) if _server["env"] == env else None


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              start_method: str | None = None, may_die: tuple[int, ...] = (),
              kill_after_results: bool = False, fail_fast: bool = False,
              ignore_sigint: bool = False, **kwargs: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes.

    ``start_method`` is multiprocessing's; by default, forks of a server process that has
    imported ctrlcomm (the ``forkserver`` method, preloaded: a rank starts in milliseconds
    instead of a fresh interpreter's start and imports), where they can stand for spawned
    processes, else ``"spawn"``: spawn where the platform has no fork server, where one
    was started by other code, where the environment changed since this module started
    its server (some variables are read when ctrlcomm is imported), and with
    ``ignore_sigint``. Each rank is a process of its own either way, with nothing of this
    process's state but what spawn passes (its ``sys.path`` and working directory).

    ``fn`` must be importable (a module-level function). Returns the results in rank order.
    Raises :class:`RankFailedError` with every failing rank's traceback if any rank raised,
    exited without a result, or was still running after ``timeout`` seconds (such ranks are
    killed, by pid: only processes this call started). Ranks in ``may_die`` may exit (or be
    killed) without a result: theirs is then ``None``; with ``kill_after_results`` they are
    killed (SIGKILL, which also ends a stopped process) once every other rank has reported.
    With ``fail_fast``, the first rank that fails (raises, or exits without a result) ends
    the run at once: the ranks still running are killed (they may be waiting for it).
    With ``ignore_sigint``, the ranks ignore SIGINT from their start on (a terminal's Ctrl-C
    reaches every process of its group: the caller stops the ranks instead), Python's
    start-up included, during which SIGINT stays blocked.
    """
    server = _fork_server() if start_method is None and not ignore_sigint else None
    method = start_method or ("forkserver" if server is not None else "spawn")
    ctx: Any = mp.get_context(method)
    q = ctx.Queue()
    # (the death signal follows the thread that started a process: only the main thread's
    # ranks are tied to it; under forkserver a rank's parent is the server, which ends
    # with this process: a rank of the server this module started is tied to it)
    parent = os.getpid() if threading.current_thread() is threading.main_thread() \
        and method in ("spawn", "fork") else server
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, world_size, args, kwargs, q, parent, ignore_sigint))
             for r in range(world_size)]
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    failures: dict[int, str] = {}
    try:
        with _sigint_held(ignore_sigint):
            for p in procs:
                p.start()
        while len(results) < world_size:
            try:
                rank, ok, out = q.get(timeout=0.2)
                results[rank] = (ok, out)  # (in the order they come: see fail_fast below)
                if ok or not fail_fast:
                    continue
            except queue.Empty:
                pass
            except (OSError, EOFError) as e:  # a result that cannot be rebuilt here
                raise RankFailedError(
                    f"a rank's result could not be received: {e!r} (results must be plain "
                    "picklable data: torch tensors, for one, cannot outlive their process "
                    "through a multiprocessing queue)", {}) from e
            if kill_after_results and all(r in results for r in range(world_size)
                                          if r not in may_die):
                for r in may_die:
                    if r not in results and procs[r].pid is not None:
                        os.kill(procs[r].pid, signal.SIGKILL)
                        results[r] = (True, None)
            for r, p in enumerate(procs):
                if r not in results and p.exitcode is not None and q.empty():
                    # allow the queue's feeder thread a moment to deliver
                    time.sleep(0.2)
                    if q.empty() and r not in results:
                        results[r] = (r in may_die, None if r in may_die else
                                      f"exited with code {p.exitcode} and no result")
            if fail_fast:  # the first failure to come (later ones may be its consequences)
                first = next((r for r, (ok, _) in results.items() if not ok), None)
                if first is not None:
                    for r, p in enumerate(procs):
                        if r not in results:
                            results[r] = (False, f"stopped: rank {first} failed first")
                            if p.is_alive() and p.pid is not None:
                                os.kill(p.pid, signal.SIGKILL)
                    break
            if time.monotonic() > deadline:
                for r in range(world_size):
                    if r not in results:
                        results[r] = (False, f"still running after {timeout:g} s")
                break
    except BaseException:  # Ctrl-C, SIGTERM made an exception, a result that cannot be read
        for p in procs:  # the ranks are not waited for: stopped at once
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
        raise
    finally:
        for p in procs:
            if p.pid is None:  # never started (interrupted before)
                continue
            p.join(timeout=max(0.0, min(5.0, deadline + 5 - time.monotonic())))
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        q.close()
    for r, (ok, out) in sorted(results.items()):
        if not ok:
            failures[r] = str(out)
    if failures:
        text = "\n".join(f"--- rank {r}: {msg}" for r, msg in failures.items())
        raise RankFailedError(f"{len(failures)} of {world_size} ranks failed:\n{text}", failures)
    return [results[r][1] for r in range(world_size)]


def _group_child(rank: int, size: int, fn: Callable[..., Any], port: int,
                 group_kwargs: dict[str, Any], args: tuple[Any, ...]) -> Any:
    from .. import Group

    kw = {"timeout": 30.0, **group_kwargs}
    with Group.create("127.0.0.1", port, rank, size, host_store=False, **kw) as g:
        return fn(g, *args)


def run_group(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              group_kwargs: dict[str, Any] | None = None) -> list[Any]:
    """Like :func:`run_ranks`, but each rank calls ``fn(group, *args)`` with a formed group.

    The store is served from this (the parent) process on a free loopback port.
    """
    from .._transport import StoreServer

    gk = group_kwargs or {}
    with StoreServer("127.0.0.1", 0, auth_key=gk.get("auth_key"),
                     encrypt=bool(gk.get("encrypt"))) as srv:
        return run_ranks(_group_child, world_size, fn, srv.port, group_kwargs or {}, args,
                         timeout=timeout)
