"""What a rank of a bench run measures: the ops and their payloads, and the timed loops (blocking and
awaited) that every system a run compares goes through alike."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

DEFAULT_OPS = ("barrier", "all_reduce", "broadcast", "all_gather", "gather", "scatter",
               "all_to_all", "send_recv")
SIZED_OPS = {"broadcast", "all_gather", "gather", "scatter", "all_to_all", "send_recv",
             "all_reduce"}
ROOTED = {"broadcast", "gather", "scatter", "send_recv"}
SMALL = 64  # sizes up to this use the "small object" payload: a dict, or two ints to reduce
# Environment of every rank (for every system alike), unless the user set these: numpy's
# OpenBLAS and torch's OpenMP with one thread, as torchrun starts its workers
# (OMP_NUM_THREADS=1). Measured: a rank that imports numpy gets a worker per further CPU that
# spins about 0.1 s; at world 2 that spin took 0.04-0.07 s of a 0.15 s run on each rank and
# raised its CPU time per op above its wall time.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def one_thread_pools() -> Any:
    """Set :data:`ONE_THREAD` where unset, for the processes started meanwhile."""
    added = [k for k in ONE_THREAD if k not in os.environ]
    for k in added:
        os.environ[k] = ONE_THREAD[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


# a size's suffixes and their multipliers, the longer of two that end alike first
_SUFFIXES = tuple((p + end, m) for p, m in (("K", 1024), ("M", 1024**2), ("G", 1024**3))
                  for end in ("IB", "B", "")) + (("B", 1),)


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``8B``, ``1K``, ``64K``, ``1M``, ``2MiB``, ``1.5k`` (powers of 1024).
    Raises ValueError naming the text for anything else: a size below one byte or not a
    whole number of bytes among them (size 0 stands for the ops without a payload)."""
    t = text.strip().upper()
    mult = 1
    for end, m in _SUFFIXES:
        if t.endswith(end):
            mult, t = m, t[:-len(end)]
            break
    try:
        n = float(t)
    except ValueError:
        n = float("nan")
    if not n > 0 or n == float("inf") or n * mult != int(n * mult):  # (nan fails n > 0)
        raise ValueError(f"not a payload size: {text!r} (a whole number of bytes >= 1, "
                         "e.g. 8, 1K, 64K, 1M)")
    return int(n * mult)


def env_key() -> bytes | None:
    """``CTRLCOMM_AUTH_KEY``, which every group the bench forms takes from the environment:
    the bench's store needs it too (it ran without, and the ranks refused it)."""
    from ..transport._net import auth_key_or_env

    return auth_key_or_env()


class _Marker:
    """Stands for one payload in :func:`most_per_message`."""


def _markers(obj: Any) -> int:
    if type(obj) is _Marker:
        return 1
    if isinstance(obj, (list, tuple)):
        return sum(map(_markers, obj))
    if isinstance(obj, dict):
        return sum(map(_markers, obj.values()))
    return 0


def fmt_size(n: int) -> str:
    for unit, m in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def payload(op: str, size: int, rank: int, i: int) -> Any:
    if op == "all_reduce":
        if size <= SMALL:
            return (rank + i, 1)
        import numpy as np

        return np.full(size // 8, rank, dtype=np.int64)
    if size <= SMALL:
        return {"rank": rank, "step": i, "ok": True}
    return os.urandom(size) if i < 0 else b"x" * size


PAIR_OPS = {"send_recv"}  # between two ranks: nothing to measure at world size 1


def ops_at(ops: Sequence[str], n: int, stream: Any = None) -> list[str]:
    """The ops of ``ops`` that world size ``n`` can run (at 1: not send_recv, which needs two
    ranks), saying on ``stream`` which are left out."""
    out = [op for op in ops if n >= 2 or op not in PAIR_OPS]
    if stream is not None and len(out) < len(ops):
        left = ", ".join(op for op in ops if op not in out)
        stream.write(f"{left}: needs 2 ranks, left out at world size {n}\n")
    return out


def op_sizes(ops: list[str], sizes: list[int]) -> list[tuple[str, int]]:
    """Each (op, size) to measure, once, in the order given (size 0: an op without one)."""
    out = []
    for op in dict.fromkeys(ops):
        if op in SIZED_OPS:
            out += [(op, s) for s in dict.fromkeys(sizes)]
        else:
            out.append((op, 0))
    return out


# ------------------------------------------------------------------ ctrlcomm (one rank)


def _ctrlcomm_calls(g: Any, api: Any, rank: int, n: int) -> dict[str, Callable[[Any], Any]]:
    peer = 1 if n > 1 else 0

    def send_recv(obj: Any) -> Any:  # ping-pong between ranks 0 and 1
        if n == 1:
            return None
        if rank == 0:
            g.send(obj, peer)
            return g.recv(peer)
        if rank == peer:
            g.send(g.recv(0), 0)
        return None

    async def asend_recv(obj: Any) -> Any:
        if n == 1:
            return None
        if rank == 0:
            g.send(obj, peer)
            return await api.recv(peer)
        if rank == peer:
            g.send(await api.recv(0), 0)
        return None

    return {
        "barrier": lambda obj: api.barrier(),
        "all_reduce": lambda obj: api.all_reduce(obj, op="sum"),
        "broadcast": lambda obj: api.broadcast(obj, src=0),
        "all_gather": lambda obj: api.all_gather(obj),
        "gather": lambda obj: api.gather(obj, dst=0),
        "scatter": lambda obj: api.scatter([obj] * n if rank == 0 else None, src=0),
        "all_to_all": lambda obj: api.all_to_all([obj] * n),
        "send_recv": send_recv if api is g else asend_recv,
    }


def _measure_sync(calls: Mapping[str, Callable[[Any], Any]], sync: Callable[[], Any],
                  plan: list[tuple[str, int]], rank: int, iters: int, warmup: int,
                  progress: Callable[[str, int], None]) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for op, size in plan:
        f = calls[op]
        objs = [payload(op, size, rank, i) for i in range(2)]
        for i in range(warmup):
            f(objs[i % 2])
            if op in ROOTED:
                sync()
        sync()
        times = []
        cpu = 0.0
        for i in range(iters):
            c0 = time.process_time()
            t0 = time.perf_counter()
            f(objs[i % 2])
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            if op in ROOTED:
                sync()
        out[(op, size)] = {"times": times, "cpu": cpu / iters}
        progress(op, size)
    return out


async def _measure_async(calls: Mapping[str, Callable[[Any], Any]], sync: Callable[[], Any],
                         plan: list[tuple[str, int]], rank: int, iters: int, warmup: int,
                         progress: Callable[[str, int], None]
                         ) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for op, size in plan:
        f = calls[op]
        objs = [payload(op, size, rank, i) for i in range(2)]
        for i in range(warmup):
            r = f(objs[i % 2])
            if asyncio.iscoroutine(r):
                await r
            if op in ROOTED:
                await sync()
        await sync()
        times = []
        cpu = 0.0
        for i in range(iters):
            c0 = time.process_time()
            t0 = time.perf_counter()
            r = f(objs[i % 2])
            if asyncio.iscoroutine(r):
                await r
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            if op in ROOTED:
                await sync()
        out[(op, size)] = {"times": times, "cpu": cpu / iters}
        progress(op, size)
    return out


# ------------------------------------------------------------------------- aggregation


Results = dict[tuple[str, int], dict[str, Any]]
