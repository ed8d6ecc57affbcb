"""The systems ``ctrlcomm bench --against`` compares with, run the way their users run them.

These are reference implementations of *other* designs, kept apart from ctrlcomm's own
layers on purpose (they open their own sockets, through torch or ZeroMQ):

- ``gloo``: torch.distributed with the gloo backend; object collectives for objects
  (``broadcast_object_list``, ``all_gather_object``...), a 2-element int64 tensor for
  all_reduce of two ints.
- ``store``: a TCPStore as the data plane, following the algorithm of vLLM's original
  ``StatelessProcessGroup`` (``../shared/seeds``): a broadcast is a ``set`` by the source and a
  ``get`` by every other rank under ``broadcast_from/{src}/{counter}``; all_gather and barrier
  are N broadcasts; p2p is ``send_to/{dst}/{counter}``. Ops the original lacks are built from
  its primitives the way its users do (all_reduce = all_gather then reduce locally).
- ``star``: the design of Megatron's original ``AsyncZMQCommunicator`` for all_reduce: every
  rank PUSHes its ints to rank 0, which reduces and PUBlishes the result; blocking receives.
- ``mpi``: mpi4py over MPICH, launched with MPICH's ``mpiexec`` (see :func:`run_mpi`).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ._measure import SMALL, Results, _measure_sync, op_sizes

# every wait of a baseline ends within this many seconds (a rank whose peer died then fails
# with an error instead of hanging the whole bench)
DEADLINE_S = 300


def _reduce_sum(vals: list[Any]) -> Any:
    acc = vals[0]
    for v in vals[1:]:
        acc = tuple(a + b for a, b in zip(acc, v, strict=True)) if isinstance(acc, tuple) \
            else acc + v
    return acc


def _share_ports(cfg: dict[str, Any], rank: int, what: str,
                 ports: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Rank 0 publishes the ``ports`` of listeners it bound to port 0 (the OS picks free
    ones), through the bench's own store; the other ranks get them. (A port picked ahead and
    bound later can be taken meanwhile by any connection of the machine: rank 0 then fails to
    bind, and the others wait for it.)"""
    from ..rendezvous._client import StoreClient
    from ._measure import env_key

    store = StoreClient(cfg["host"], cfg["port"], timeout=DEADLINE_S,
                        prefix=f"bench/{cfg['tag']}/", auth_key=env_key())
    try:
        if rank == 0:
            store.set(what, ",".join(map(str, ports)))
            return ports
        return tuple(int(p) for p in store.get(what).split(b","))
    finally:
        store.close()


def _tcp_store(cfg: dict[str, Any], rank: int, n: int) -> Any:
    """A torch TCPStore served by rank 0 on a port its OS picked."""
    from datetime import timedelta

    import torch.distributed as dist

    t = timedelta(seconds=DEADLINE_S)
    if rank == 0:
        # (not waiting for the others in the constructor: they learn the port after it)
        store = dist.TCPStore(cfg["host"], 0, n, True, timeout=t,  # type: ignore[attr-defined]
                              wait_for_workers=False)
        _share_ports(cfg, rank, "tcpstore", (int(store.port),))
        return store
    (port,) = _share_ports(cfg, rank, "tcpstore")
    return dist.TCPStore(cfg["host"], port, n, False, timeout=t)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ gloo


def system_gloo(rank: int, n: int, cfg: dict[str, Any], progress: Callable[[str, int], None]
                ) -> Results:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=_tcp_store(cfg, rank, n), rank=rank, world_size=n,
                            timeout=timedelta(seconds=DEADLINE_S))

    def all_reduce(obj: Any) -> Any:
        t = torch.tensor(obj, dtype=torch.int64) if isinstance(obj, tuple) else torch.from_numpy(obj)
        dist.all_reduce(t)
        return t

    def broadcast(obj: Any) -> Any:
        box = [obj if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(obj: Any) -> Any:
        out = [None] * n
        dist.all_gather_object(out, obj)
        return out

    def gather(obj: Any) -> Any:
        out = [None] * n if rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def scatter(obj: Any) -> Any:
        out = [None]
        dist.scatter_object_list(out, [obj] * n if rank == 0 else None, src=0)
        return out[0]

    def send_recv(obj: Any) -> Any:
        if n == 1:
            return None
        box = [obj]
        if rank == 0:
            dist.send_object_list(box, dst=1)
            dist.recv_object_list(box, src=1)
        elif rank == 1:
            dist.recv_object_list(box, src=0)
            dist.send_object_list(box, dst=0)
        return box[0]

    calls = {"barrier": lambda obj: dist.barrier(), "all_reduce": all_reduce,
             "broadcast": broadcast, "all_gather": all_gather, "gather": gather,
             "scatter": scatter, "send_recv": send_recv}
    plan = [(op, s) for op, s in op_sizes(cfg["ops"], cfg["sizes"]) if op in calls]
    try:
        return _measure_sync(calls, dist.barrier, plan, rank, cfg["iters"], cfg["warmup"],
                             progress)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- store


class _StoreGroup:
    """vLLM's original StatelessProcessGroup algorithm over a torch TCPStore."""

    def __init__(self, store: Any, rank: int, n: int) -> None:
        self.store, self.rank, self.world_size = store, rank, n
        self.send_dst_counter = dict.fromkeys(range(n), 0)
        self.recv_src_counter = dict.fromkeys(range(n), 0)
        self.broadcast_send_counter = 0
        self.broadcast_recv_src_counter = dict.fromkeys(range(n), 0)
        self.entries: collections.deque[tuple[str, float]] = collections.deque()
        self.data_expiration_seconds = 3600

    def expire_data(self) -> None:
        while self.entries:
            key, ts = self.entries[0]
            if time.perf_counter() - ts > self.data_expiration_seconds:
                self.store.delete_key(key)
                self.entries.popleft()
            else:
                break

    def send_obj(self, obj: Any, dst: int) -> None:
        self.expire_data()
        key = f"send_to/{dst}/{self.send_dst_counter[dst]}"
        self.store.set(key, pickle.dumps(obj))
        self.send_dst_counter[dst] += 1
        self.entries.append((key, time.perf_counter()))

    def recv_obj(self, src: int) -> Any:
        obj = pickle.loads(self.store.get(f"send_to/{self.rank}/{self.recv_src_counter[src]}"))
        self.recv_src_counter[src] += 1
        return obj

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            self.expire_data()
            key = f"broadcast_from/{src}/{self.broadcast_send_counter}"
            self.store.set(key, pickle.dumps(obj))
            self.broadcast_send_counter += 1
            self.entries.append((key, time.perf_counter()))
            return obj
        key = f"broadcast_from/{src}/{self.broadcast_recv_src_counter[src]}"
        got = pickle.loads(self.store.get(key))
        self.broadcast_recv_src_counter[src] += 1
        return got

    def all_gather_obj(self, obj: Any) -> list[Any]:
        out = []
        for i in range(self.world_size):
            if i == self.rank:
                out.append(obj)
                self.broadcast_obj(obj, src=self.rank)
            else:
                out.append(self.broadcast_obj(None, src=i))
        return out

    def barrier(self) -> None:
        for i in range(self.world_size):
            self.broadcast_obj(None, src=i)


def system_store(rank: int, n: int, cfg: dict[str, Any], progress: Callable[[str, int], None]
                 ) -> Results:
    store = _tcp_store(cfg, rank, n)
    g = _StoreGroup(store, rank, n)

    def gather(obj: Any) -> Any:
        if rank == 0:
            return [obj] + [g.recv_obj(s) for s in range(1, n)]
        g.send_obj(obj, 0)
        return None

    def scatter(obj: Any) -> Any:
        if rank == 0:
            for d in range(1, n):
                g.send_obj(obj, d)
            return obj
        return g.recv_obj(0)

    def all_to_all(obj: Any) -> Any:
        for d in range(n):
            if d != rank:
                g.send_obj(obj, d)
        return [obj if s == rank else g.recv_obj(s) for s in range(n)]

    def send_recv(obj: Any) -> Any:
        if n == 1:
            return None
        if rank == 0:
            g.send_obj(obj, 1)
            return g.recv_obj(1)
        if rank == 1:
            g.send_obj(g.recv_obj(0), 0)
        return None

    calls = {
        "barrier": lambda obj: g.barrier(),
        "all_reduce": lambda obj: _reduce_sum(g.all_gather_obj(obj)),
        "broadcast": lambda obj: g.broadcast_obj(obj, src=0),
        "all_gather": g.all_gather_obj,
        "gather": gather, "scatter": scatter, "all_to_all": all_to_all, "send_recv": send_recv,
    }
    plan = op_sizes(cfg["ops"], cfg["sizes"])
    out = _measure_sync(calls, g.barrier, plan, rank, cfg["iters"], cfg["warmup"], progress)
    # rank 0 serves the store: it stays until every rank has finished reading from it (not
    # after a failure: the others, waiting for what it never wrote, would never come)
    store.add("bench/done", 1)
    if rank == 0:
        deadline = time.monotonic() + 60
        while store.add("bench/done", 0) < n and time.monotonic() < deadline:
            time.sleep(0.01)
    return out


# ------------------------------------------------------------------------------ star


def system_star(rank: int, n: int, cfg: dict[str, Any], progress: Callable[[str, int], None]
                ) -> Results:
    """Megatron's original AsyncZMQCommunicator design, for all_reduce only."""
    import numpy as np
    import zmq

    ctx = zmq.Context()
    # blocking receives, as the original's, but not for ever: a rank whose peer died fails
    # (zmq.Again) instead of hanging the bench
    ctx.setsockopt(zmq.RCVTIMEO, DEADLINE_S * 1000)
    ctx.setsockopt(zmq.SNDTIMEO, DEADLINE_S * 1000)
    host = cfg["host"]
    if rank == 0:
        pull = ctx.socket(zmq.PULL)
        pub = ctx.socket(zmq.PUB)
        _share_ports(cfg, rank, "star", (pull.bind_to_random_port(f"tcp://{host}"),
                                         pub.bind_to_random_port(f"tcp://{host}")))
    else:
        pull_port, pub_port = _share_ports(cfg, rank, "star")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://{host}:{pull_port}")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{host}:{pub_port}")
    # the slow-joiner handshake the original lacks: the leader publishes until all answered
    deadline = time.monotonic() + DEADLINE_S
    if rank == 0:
        joined: set[int] = set()
        while len(joined) < n - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"star: ranks {sorted(set(range(1, n)) - joined)} did not "
                                   f"join within {DEADLINE_S} s")
            pub.send(b"hello")
            if pull.poll(50):
                joined.add(int(pull.recv()))
        pub.send(b"go")
    else:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"star: rank 0 did not publish within {DEADLINE_S} s")
            if sub.poll(1000) and sub.recv() == b"hello":
                push.send(str(rank).encode())
                break
        while sub.recv() != b"go":
            pass

    def all_reduce(obj: Any) -> Any:
        vals = np.array(obj, dtype=np.int64) if isinstance(obj, tuple) else obj
        if rank == 0:
            acc = vals.copy()
            for _ in range(n - 1):
                acc = acc + np.frombuffer(pull.recv(), dtype=np.int64)
            pub.send(acc.tobytes())
            return acc
        push.send(vals.tobytes())
        return np.frombuffer(sub.recv(), dtype=np.int64)

    def sync() -> None:
        all_reduce((0, 0))

    # the original is for a few ints; with large payloads its PUB socket drops messages at its
    # high-water mark and a subscriber then waits forever, so it runs with small ones only
    plan = [(op, s) for op, s in op_sizes(cfg["ops"], cfg["sizes"])
            if op == "all_reduce" and s <= SMALL]
    try:
        return _measure_sync({"all_reduce": all_reduce}, sync, plan, rank, cfg["iters"],
                             cfg["warmup"], progress)
    finally:
        ctx.destroy(linger=0)


# ------------------------------------------------------------------------------- mpi


def mpiexec() -> str | None:
    """MPICH's mpiexec next to this Python (the ``mpich`` wheel), or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    return shutil.which("mpiexec")


def mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'ctrlcomm[mpi]')"
    if mpiexec() is None:
        return "no mpiexec found (pip install mpich)"
    try:
        import numpy  # noqa: F401
    except ImportError:  # (its all_reduce sends numpy arrays, as MPI's buffer calls take)
        return "numpy is not installed (pip install 'ctrlcomm[mpi]')"
    return None


def _ended_with_parent() -> Callable[[], None] | None:
    """What a process started here runs before it executes its program so that it gets
    SIGTERM when the thread that started it ends (Linux's PR_SET_PDEATHSIG): mpiexec then
    ends its ranks also where the bench was killed outright (SIGKILL), before any cleanup of
    its own could run; None where there is no prctl."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # (looked up here, not in the child)
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def tie() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # (the parent ended before that)
            os.kill(os.getpid(), signal.SIGTERM)

    return tie


MPI_TMP = "ctrlcomm-bench-mpi-"  # + the bench's pid + "-": the folder of a run's files
STALE_TMP_S = 3600.0  # a folder of a bench no longer running is removed once this old


def sweep_stale_tmp(root: str | None = None, now: float | None = None) -> list[str]:
    """Remove the folders of MPI runs whose bench was killed outright (SIGKILL: it could
    not remove its own), in ``root`` (the temporary folder): this user's, of a pid not
    running, untouched for :data:`STALE_TMP_S` (beyond any run's timeout: a bench of
    another pid namespace sharing the folder, whose pid this one cannot see, may still
    run). Returns those removed."""
    root = root or tempfile.gettempdir()
    now = time.time() if now is None else now
    gone: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return gone
    for e in entries:
        pid = e.name[len(MPI_TMP):].split("-", 1)[0]
        if not e.name.startswith(MPI_TMP) or not pid.isdecimal() or int(pid) == os.getpid():
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if not e.is_dir(follow_symlinks=False) or st.st_uid != os.getuid() \
                    or now - st.st_mtime < STALE_TMP_S:
                continue
            os.kill(int(pid), 0)
            continue  # (running)
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):  # (PermissionError: another user's process runs)
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        gone.append(e.path)
    return gone


def run_mpi(n: int, cfg: dict[str, Any]) -> list[Results]:
    """Run the ops under ``mpiexec -n N`` (MPICH) and collect each rank's figures. Raises
    ``subprocess.SubprocessError`` if it fails or runs past ``cfg["timeout"]`` (default 900 s;
    then, or when the wait is interrupted, mpiexec and every process it started are killed:
    they run in a session of their own), ``OSError``/``ValueError`` if a rank's figures are
    missing or unreadable."""
    exe = mpiexec()
    assert exe is not None
    timeout = cfg.get("timeout", 900)
    sweep_stale_tmp()
    with tempfile.TemporaryDirectory(prefix=f"{MPI_TMP}{os.getpid()}-") as tmp:
        cfg_path = os.path.join(tmp, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump({k: cfg[k] for k in ("ops", "sizes", "iters", "warmup")}, f)
        cmd = [exe, "-n", str(n), sys.executable, "-m", "ctrlcomm.bench._mpi", cfg_path, tmp]
        env = dict(os.environ, MPIR_CVAR_CH4_NETMOD="", HYDRA_LAUNCHER="fork")
        err_path = os.path.join(tmp, "stderr")
        with open(err_path, "wb") as err, \
                subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True, preexec_fn=_ended_with_parent()) as p:
            try:
                code = p.wait(timeout)
            except BaseException:  # past the timeout, or Ctrl-C / SIGTERM to the bench
                os.killpg(p.pid, signal.SIGKILL)  # the session started here, and only it
                p.wait()
                raise
        if code:
            # what the ranks said last (their tracebacks' last lines), not their tracebacks
            with open(err_path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
            # (a traceback's frames and source lines are indented; what was raised is not)
            said = [ln.strip() for ln in lines
                    if ln.strip() and not ln[:1].isspace() and not ln.startswith("Traceback")]
            why = "; ".join(dict.fromkeys(said[-3:])) or "nothing on stderr"
            raise subprocess.SubprocessError(f"mpiexec -n {n} exited with status {code}: "
                                             f"{why[:500]}")
        out = []
        for r in range(n):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                raw = json.load(f)
            out.append({(op, int(size)): v for op, size, v in raw})
        return out


SYSTEMS: dict[str, Callable[..., Results]] = {
    "gloo": system_gloo,
    "store": system_store,
    "star": system_star,
}


def missing(system: str) -> str | None:
    """Why ``system`` cannot run here (None if it can)."""
    if system in ("gloo", "store"):
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch is not installed (pip install 'ctrlcomm[torch]')"
    if system == "star":
        try:
            import numpy  # noqa: F401
        except ImportError:
            return "numpy is not installed (pip install numpy)"
    if system == "mpi":
        return mpi_missing()
    return None
