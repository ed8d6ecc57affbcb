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
from collections.abc import Callable, Iterator, Sequence
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
           ignore_sigint: bool = False, given: Any = None) -> None:
    if ignore_sigint:  # (blocked since the fork: a Ctrl-C meanwhile is dropped here)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if parent == 0:  # a fork of the server: tied to it (it ends with the runner)
        _leave_server()
        parent = os.getppid()
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


# The fork server ranks start from by default, where its forks can stand for spawned
# processes: its pid, the process that started it, and what a process it starts inherits
# from this one as things were when it started (see _inherited).
_server: dict[str, Any] = {"pid": None, "owner": None, "state": None, "failed": False}
_server_lock = threading.Lock()
_CARRIED = ("PYTEST_CURRENT_TEST",)  # (pytest's, set anew for each test: given to each rank)


def _umask() -> str | None:
    try:  # (reading it with os.umask would change it for a moment, for every thread)
        with open("/proc/self/status") as f:
            return next((ln.split()[1] for ln in f if ln.startswith("Umask:")), None)
    except OSError:
        return None


def _inherited() -> tuple[Any, ...]:
    """What a spawned process takes from this one (and from this thread) besides what spawn
    passes (sys.path, the working directory) and its standard output and error (given to
    each rank): the environment, ignored signals, the signal mask, CPU affinity, umask,
    niceness, resource limits, ids. A fork server's child takes them from the server, as
    they were when it started; where they differ, ranks are spawned."""
    import resource

    env = {k: v for k, v in os.environ.items() if k not in _CARRIED}
    ignored = frozenset(s for s in signal.valid_signals()
                        if signal.getsignal(s) == signal.SIG_IGN)
    limits = tuple(resource.getrlimit(getattr(resource, n)) for n in sorted(dir(resource))
                   if n.startswith("RLIMIT_"))
    return (env, ignored, frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, ())),
            frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            _umask(), os.getpriority(os.PRIO_PROCESS, 0), limits, os.getresuid(),
            os.getresgid())


def _fork_server() -> bool:
    """Whether ranks can start as forks of a server preloaded with ctrlcomm, started by
    this module in this process, and stand for spawned processes (a fresh interpreter's
    start and ctrlcomm's import, 0.3-0.8 s per rank here, saved): not where there is no
    fork server on this platform, where other code started one (its preloads and state
    unknown), where this process is a fork of the one that started it, where it failed to
    start (a preload of the caller's that raised), or where what a process inherits from
    this one changed since it started (:func:`_inherited`: the environment, for one, of
    which ctrlcomm reads some variables when imported)."""
    if "forkserver" not in mp.get_all_start_methods() or not hasattr(os, "getresuid"):
        return False
    from multiprocessing import forkserver

    fs = getattr(forkserver, "_forkserver", None)
    if not all(hasattr(fs, a) for a in ("_forkserver_pid", "_preload_modules",
                                        "_forkserver_alive_fd")):
        return False  # (another Python's multiprocessing: spawn)
    state = _inherited()
    with _server_lock:
        if _server["failed"]:
            return False
        if _server["pid"] is None:
            if fs._forkserver_pid is not None:  # type: ignore[union-attr]
                return False
            preload = list(fs._preload_modules or [])  # type: ignore[union-attr]
            forkserver.set_forkserver_preload(preload + ["ctrlcomm", "ctrlcomm.testing"])
        elif _server["owner"] != os.getpid():
            return False  # (a fork of the process that started it: not its child)
        try:
            forkserver.ensure_running()  # (started, or started again where it died)
        except Exception:  # (it could not be started: spawn, as before there was one)
            _server["failed"] = True
            return False
        pid = fs._forkserver_pid  # type: ignore[union-attr]
        if pid != _server["pid"]:
            _server.update(pid=pid, owner=os.getpid(), state=state)
        return bool(_server["state"] == state)


class _Given:
    """What a rank takes from the process that starts it at that moment, where it is a fork
    of the server (which has this process's as they were when it started): its standard
    output and error (file descriptors, passed as multiprocessing passes them) and
    :data:`_CARRIED` variables. Taken as the rank unpickles its arguments, before it runs
    anything else (the rank's argument is then None)."""

    def __init__(self) -> None:
        self.env = {k: os.environ.get(k) for k in _CARRIED}

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        fds: list[Any] = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # (closed here: left as the server's)
                fds.append(None)
            else:
                fds.append(reduction.DupFd(fd))
        return (_take, (fds, self.env))


def _take(fds: list[Any], env: dict[str, str | None]) -> None:
    for fd, target in zip(fds, (1, 2), strict=True):
        if fd is not None:
            got = fd.detach()
            os.dup2(got, target)
            os.close(got)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _leave_server() -> None:
    """In a rank forked by the server: close the server's "alive" pipe, which each of its
    children inherits. The server ends when every holder has closed it; with the ranks
    holding it, it would outlive a runner killed (SIGKILL), and so would they."""
    from multiprocessing import forkserver

    fs = getattr(forkserver, "_forkserver", None)
    fd = getattr(fs, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        fs._forkserver_alive_fd = None  # type: ignore[union-attr]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              start_method: str | None = None, may_die: tuple[int, ...] = (),
              kill_after_results: bool = False, fail_fast: bool = False,
              ignore_sigint: bool = False, **kwargs: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes.

    ``start_method`` is multiprocessing's; by default, forks of a server process that has
    imported ctrlcomm (the ``forkserver`` method, preloaded: a rank starts in milliseconds
    instead of a fresh interpreter's start and imports), where they can stand for spawned
    processes, else ``"spawn"``: spawn where the platform has no fork server, where one
    was started by other code, in a fork of the process that started it, where what a
    spawned process would take from this one (the environment, of which ctrlcomm reads
    some variables when imported; ignored signals, the signal mask, CPU affinity, umask,
    niceness, limits) changed since this module started its server, and with
    ``ignore_sigint``. A fork of the server takes this process's standard output and error
    as they are when it starts (pytest's ``capfd`` sees what ranks print), and its ranks
    end with the server, which ends with this process.

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
    run = _Run(fn, world_size, args, kwargs, timeout, start_method, may_die, ignore_sigint)
    try:
        run.start()
        while len(run.results) < world_size:
            ok = run.take()
            if ok or (ok is False and not fail_fast):  # (the checks below: when none came,
                continue  # or a failure with fail_fast)
            if kill_after_results:
                run.kill_may_die_once_others_reported()
            run.note_exited()
            if fail_fast and run.stop_at_first_failure():  # (later ones may be its
                break  # consequences)
            if time.monotonic() > run.deadline:
                for r in range(world_size):
                    run.results.setdefault(r, (False, f"still running after {timeout:g} s"))
                break
    except BaseException:  # Ctrl-C, SIGTERM made an exception, a result that cannot be read
        run.kill()  # the ranks are not waited for: stopped at once
        raise
    finally:
        run.reap()
    failures = {r: str(out) for r, (ok, out) in sorted(run.results.items()) if not ok}
    if failures:
        text = "\n".join(f"--- rank {r}: {msg}" for r, msg in failures.items())
        raise RankFailedError(f"{len(failures)} of {world_size} ranks failed:\n{text}", failures)
    return [run.results[r][1] for r in range(world_size)]


class _Run:
    """The processes of one :func:`run_ranks` call and what they reported."""

    def __init__(self, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...],
                 kwargs: dict[str, Any], timeout: float, start_method: str | None,
                 may_die: tuple[int, ...], ignore_sigint: bool) -> None:
        self.fn, self.world_size, self.args, self.kwargs = fn, world_size, args, kwargs
        self.start_method, self.may_die, self.ignore_sigint = start_method, may_die, ignore_sigint
        self.forked = start_method is None and not ignore_sigint and _fork_server()
        self.q, self.procs = self._make(self.forked)
        self.results: dict[int, tuple[bool, Any]] = {}
        self.deadline = time.monotonic() + timeout

    def _make(self, forked: bool) -> tuple[Any, list[Any]]:
        """The queue and the processes: forks of the server, or by ``start_method``."""
        ctx: Any = mp.get_context("forkserver" if forked else self.start_method or "spawn")
        q = ctx.Queue()
        # (the death signal follows the thread that started a process: only the main
        # thread's ranks are tied to it; under forkserver a rank's parent is the server,
        # which ends with this process: a fork of the server this module started is tied
        # to it, 0)
        parent: int | None = None
        if forked:
            parent = 0
        elif threading.current_thread() is threading.main_thread() \
                and ctx.get_start_method() in ("spawn", "fork"):
            parent = os.getpid()
        given = _Given() if forked else None
        return q, [ctx.Process(target=_child, daemon=True,
                               args=(self.fn, r, self.world_size, self.args, self.kwargs, q,
                                     parent, self.ignore_sigint, given))
                   for r in range(self.world_size)]

    def start(self) -> None:
        if self.forked:
            try:
                self.procs[0].start()
            except Exception:  # the server could not start one: a preload that raised, say
                with _server_lock:
                    _server["failed"] = True
                self.q.close()
                self.q, self.procs = self._make(False)
        with _sigint_held(self.ignore_sigint):
            for p in self.procs:
                if p.pid is None:
                    p.start()

    def take(self) -> bool | None:
        """A rank's result, where one comes within 0.2 s: whether it is one (None: none
        came)."""
        try:
            rank, ok, out = self.q.get(timeout=0.2)
        except queue.Empty:
            return None
        except (OSError, EOFError) as e:  # a result that cannot be rebuilt here
            raise RankFailedError(
                f"a rank's result could not be received: {e!r} (results must be plain "
                "picklable data: torch tensors, for one, cannot outlive their process "
                "through a multiprocessing queue)", {}) from e
        self.results[rank] = (ok, out)  # (in the order they come: see stop_at_first_failure)
        return bool(ok)

    def kill_may_die_once_others_reported(self) -> None:
        if all(r in self.results for r in range(self.world_size) if r not in self.may_die):
            for r in self.may_die:
                if r not in self.results and self.procs[r].pid is not None:
                    self.procs[r].kill()
                    self.results[r] = (True, None)

    def note_exited(self) -> None:
        """Ranks that exited without a result."""
        for r, p in enumerate(self.procs):
            if r not in self.results and p.exitcode is not None and self.q.empty():
                # allow the queue's feeder thread a moment to deliver
                time.sleep(0.2)
                if self.q.empty() and r not in self.results:
                    dies = r in self.may_die
                    self.results[r] = (dies, None if dies else
                                       f"exited with code {p.exitcode} and no result")

    def stop_at_first_failure(self) -> bool:
        """Where a rank failed: the others stopped (True)."""
        first = next((r for r, (ok, _) in self.results.items() if not ok), None)
        if first is None:
            return False
        for r, p in enumerate(self.procs):
            if r not in self.results:
                self.results[r] = (False, f"stopped: rank {first} failed first")
                if p.is_alive() and p.pid is not None:
                    p.kill()
        return True

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                p.kill()

    def reap(self) -> None:
        # (Process.kill: a rank that ended since is_alive() said it ran, reaped by the fork
        # server, is no longer there, and kill() takes ProcessLookupError as that)
        for p in self.procs:
            if p.pid is None:  # never started (interrupted before)
                continue
            p.join(timeout=max(0.0, min(5.0, self.deadline + 5 - time.monotonic())))
            if p.is_alive() and p.pid is not None:
                p.kill()
                p.join(5)
        self.q.close()


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
    from ..rendezvous._server import StoreServer
    from ..transport._net import auth_key_or_env

    gk = group_kwargs or {}
    key = auth_key_or_env(gk.get("auth_key"))  # (as Group.create takes it)
    with StoreServer("127.0.0.1", 0, auth_key=key, encrypt=bool(gk.get("encrypt"))) as srv:
        return run_ranks(_group_child, world_size, fn, srv.port, group_kwargs or {}, args,
                         timeout=timeout)


def kill_ranks(group: Any, victims: Sequence[int],
               before: Callable[[], None] | None = None) -> list[int]:
    """Called on every rank of ``group``: kill the processes of ranks ``victims`` (SIGKILL:
    no goodbye, as a crash), once every rank is past a barrier (a victim's all_reduce
    returns only once every rank is in it, so none is killed while another still waits in
    the barrier for it); ``before``: run by each victim just before it dies. On the other
    ranks, returns the ranks their next calls find lost (sorted)."""
    from .._errors import PeerLostError

    group.barrier()
    if group.rank in victims:
        group.all_reduce(0)
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        group.all_reduce(0)
        group.barrier()
    except PeerLostError as e:
        return sorted(e.ranks)
    raise RuntimeError(f"rank {group.rank}: no loss seen after killing ranks {list(victims)}")
