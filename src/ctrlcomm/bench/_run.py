"""``ctrlcomm bench``: an OSU-style latency suite.

Each rank runs, for every op and payload size: ``warmup`` untimed calls, then ``iters`` timed
calls. Ops whose ranks finish at different times (rooted ones, send/recv) are followed by an
untimed barrier, as OSU does, so one iteration cannot overlap the next. A figure is computed
per iteration as the slowest rank's time (when the whole collective is done), then median and
p99 across iterations; the JSON also gives median and p99 over every rank's time of every
iteration (``median_all_us``, ``p99_all_us``). CPU time is the process CPU time per op,
averaged over ranks (and, in the JSON, each rank's: ``cpu_us_per_rank``,
``cpu_frac_per_rank``): with waiting done by sleeping in the kernel it stays well below the
latency. The figures of a ping-pong (send_recv) are those of ranks 0 and 1 only, the two that
take part.

Systems are registered in :data:`SYSTEMS`; each is a function run in every rank that returns
``{(op, size): {"times": [...], "cpu": seconds_per_op}}``.

Ranks run with one-thread pools in the libraries they may load (:data:`ONE_THREAD`): a pool's
workers spin for about 0.1 s after they start (OpenBLAS, under numpy, when numpy is imported)
and would take CPUs from the ranks, and CPU time, counted per process, would count the spin.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._measure import (
    DEFAULT_OPS,
    PAIR_OPS,
    SIZED_OPS,
    SMALL,
    Results,
    _ctrlcomm_calls,
    _Marker,
    _markers,
    _measure_async,
    _measure_sync,
    env_key,
    fmt_size,
    one_thread_pools,
    op_sizes,
    ops_at,
)


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def check_cfg(cfg: Mapping[str, Any]) -> None:
    """Raise ValueError naming the setting for a benchmark configuration that cannot run."""
    bad = [o for o in cfg["ops"] if o not in DEFAULT_OPS]
    if bad or not cfg["ops"]:
        raise ValueError(f"ops {bad or '(none)'}: choose from {','.join(DEFAULT_OPS)}")
    for key, least in (("iters", 1), ("warmup", 0), ("repeat", 1)):
        v = cfg.get(key, least)
        if type(v) is not int or v < least:
            raise ValueError(f"{key} must be an integer >= {least}, got {v!r}")
    for size in cfg["sizes"]:
        if type(size) is not int or size < 1:
            raise ValueError(f"sizes must be integers >= 1 (bytes), got {size!r}")
    if "all_reduce" in cfg["ops"] and any(s > SMALL for s in cfg["sizes"]) \
            and not _importable("numpy"):
        raise ValueError(f"sizes above {SMALL} bytes: all_reduce sends them as a numpy array, "
                         "and numpy is not installed (pip install numpy), or leave those "
                         "sizes or all_reduce out")


def most_per_message(op: str, n: int) -> int:
    """The most payloads one message of ``op`` carries at world size ``n``, found by running
    the plan ctrlcomm chooses there (:func:`ctrlcomm._algo.choose`) in the in-memory
    simulator with a marker for each rank's payload: a gather's tree carries a subtree's,
    the star all_gather's result every rank's, a flat gather one. 0 where nothing is sent."""
    if n < 2 or op not in SIZED_OPS:
        return 0
    if op not in ("gather", "scatter", "all_gather"):
        return 1  # a payload or a reduced one (all_reduce), to each destination
    from .. import _algo
    from ..testing import simulate

    plan = _algo.choose(op, n)
    most = [0]

    def counted(ctx: Any) -> Any:
        mine = _Marker()
        gen = plan(ctx, mine) if op == "all_gather" else \
            plan(ctx, [_Marker() for _ in range(n)] if ctx.rank == 0 else None, 0) \
            if op == "scatter" else plan(ctx, mine, 0)
        reply = None
        while True:
            try:
                step = gen.send(reply)  # type: ignore[arg-type]  # (None: the first)
            except StopIteration as e:
                return e.value
            for _, obj in step.sends:
                most[0] = max(most[0], _markers(obj))
            reply = yield step

    simulate(counted, n, copy=False)
    return most[0]


def too_large(ops: Sequence[str], sizes: Sequence[int], world_sizes: Sequence[int]
              ) -> str | None:
    """Why a run could not send its payloads (None if it can): an op of it would put more
    in one message than a message carries (found before the run, not after it: the ranks
    would fail it one by one)."""
    from .._core import MAX_PAYLOAD

    room = MAX_PAYLOAD - 4096  # (the payload's encoding adds a few bytes)
    for n in world_sizes:
        for op in ops_at(ops, n):
            big = [s for s in sizes if s > room // max(n, 1)] if op in SIZED_OPS else []
            each = most_per_message(op, n) if big else 0  # (simulated only when it may matter)
            for s in big:
                if each and s * each > room:
                    what = f"{op} puts {each} of them" if each > 1 else f"{op} puts it"
                    return (f"--sizes {fmt_size(s)}: a payload of {s:,} bytes is too large at "
                            f"world size {n}: {what} in one message, and a message carries "
                            f"{room:,} bytes of payload at most")
    return None


def system_ctrlcomm(rank: int, n: int, cfg: dict[str, Any], progress: Callable[[str, int], None],
                    aio: bool = False, **group_kwargs: Any
                    ) -> dict[tuple[str, int], dict[str, Any]]:
    from .._group import Group

    plan = op_sizes(cfg["ops"], cfg["sizes"])
    with Group.create(cfg["host"], cfg["port"], rank, n, name=f"bench{cfg['tag']}",
                      host_store=cfg["host_store"] and rank == 0, timeout=120,
                      transport=cfg.get("transport", "shm"), **group_kwargs) as g:
        if aio:
            return asyncio.run(_measure_async(_ctrlcomm_calls(g, g.aio, rank, n), g.aio.barrier,
                                              plan, rank, cfg["iters"], cfg["warmup"], progress))
        return _measure_sync(_ctrlcomm_calls(g, g, rank, n), g.barrier, plan, rank,
                             cfg["iters"], cfg["warmup"], progress)


def system_ctrlcomm_aio(rank: int, n: int, cfg: dict[str, Any],
                        progress: Callable[[str, int], None]) -> dict[tuple[str, int], Any]:
    return system_ctrlcomm(rank, n, cfg, progress, aio=True)


def system_ctrlcomm_nohb(rank: int, n: int, cfg: dict[str, Any],
                         progress: Callable[[str, int], None]) -> dict[tuple[str, int], Any]:
    """ctrlcomm without heartbeats (liveness checks off, the heartbeat thread asleep)."""
    return system_ctrlcomm(rank, n, cfg, progress, heartbeat_interval=3600.0,
                           liveness_timeout=None)


def system_ctrlcomm_hb10ms(rank: int, n: int, cfg: dict[str, Any],
                           progress: Callable[[str, int], None]) -> dict[tuple[str, int], Any]:
    """ctrlcomm with a heartbeat every 10 ms (a hundred times the default rate)."""
    return system_ctrlcomm(rank, n, cfg, progress, heartbeat_interval=0.01,
                           liveness_timeout=1.0)


SYSTEMS: dict[str, Callable[..., dict[tuple[str, int], dict[str, Any]]]] = {
    "ctrlcomm": system_ctrlcomm,
    "ctrlcomm-aio": system_ctrlcomm_aio,
    # to measure what liveness costs: --against ctrlcomm-nohb,ctrlcomm-hb10ms
    "ctrlcomm-nohb": system_ctrlcomm_nohb,
    "ctrlcomm-hb10ms": system_ctrlcomm_hb10ms,
}


def _system(name: str) -> Callable[..., Results]:
    if name in SYSTEMS:
        return SYSTEMS[name]
    from ._baselines import SYSTEMS as OTHERS

    return OTHERS[name]


def merge(a: list[Results], b: list[Results]) -> list[Results]:
    """Pool two runs of one system (rank by rank): samples appended, CPU averaged."""
    out = []
    for ra, rb in zip(a, b, strict=True):
        out.append({k: {"times": ra[k]["times"] + rb[k]["times"],
                        "cpu": (ra[k]["cpu"] * len(ra[k]["times"]) + rb[k]["cpu"]
                                * len(rb[k]["times"])) / (len(ra[k]["times"])
                                                          + len(rb[k]["times"]))}
                    for k in ra})
    return out


def _p99(ordered: Sequence[float]) -> float:
    """The 99th percentile of sorted samples, by nearest rank: the ceil(0.99 n)-th smallest
    (of 100, the 99th, not the largest; of 1000, the 990th)."""
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def summarize(per_rank: list[Results]) -> dict[tuple[str, int], dict[str, Any]]:
    """Each (op, size)'s figures over the ranks that take part in it: every rank, but ranks 0
    and 1 alone for a ping-pong (:data:`PAIR_OPS`; the others' empty calls would pull the
    medians and the CPU towards 0). The per-rank lists give every rank, in rank order."""
    out = {}
    for key in per_rank[0]:
        takers = per_rank[:2] if key[0] in PAIR_OPS else per_rank
        runs = [r[key]["times"] for r in takers]
        slowest = [max(ts) for ts in zip(*runs, strict=True)]
        slowest.sort()
        p99 = _p99(slowest)
        every = sorted(t for ts in runs for t in ts)  # each rank's time of each iteration
        # CPU over wall time of the same calls, per rank: 1.0 would be spinning (or a rank
        # that never waits, as a broadcast's root)
        fracs = [r[key]["cpu"] * len(r[key]["times"]) / sum(r[key]["times"]) for r in per_rank]
        taking = fracs[:len(takers)]
        out[key] = {
            "median_us": statistics.median(slowest) * 1e6,
            "p99_us": p99 * 1e6,
            # the same over every rank's own time (OSU's view: a rank's latency of the call;
            # the figures above are the stricter one, when the whole collective is done)
            "median_all_us": statistics.median(every) * 1e6,
            "p99_all_us": _p99(every) * 1e6,
            "cpu_us": statistics.fmean(r[key]["cpu"] for r in takers) * 1e6,
            "cpu_frac": statistics.fmean(taking),
            # the same two for each rank, in rank order (a root's differ from the others')
            "cpu_us_per_rank": [r[key]["cpu"] * 1e6 for r in per_rank],
            "cpu_frac_per_rank": fracs,
        }
    return out


def fmt_us(us: float) -> str:
    """A time given in microseconds, in us, ms or s: at most 8 characters."""
    if us < 999.95:
        return f"{us:.1f}us"
    if us < 999_995:
        return f"{us / 1e3:.2f}ms"
    return f"{us / 1e6:.2f}s"


def fmt_ratio(r: float) -> str:
    """A ratio with two significant figures below 10 (0.02x, 0.64x, 4.3x), none after the
    point above (12x, 179x)."""
    if r >= 9.95:
        return f"{r:.0f}x"
    return f"{r:.2g}x" if r < 1 else f"{r:.1f}x"


# What a column, or a system with gaps, means: the legend says those the table shows only
LEGEND_TIMES = ("med, p99: per iteration the slowest rank's time, then the median and 99th "
                "percentile over iterations; cpu: CPU time per op per rank")
LEGEND_RATIO = "x: that system's median over {base}'s (above 1: {base} is faster)"
LEGEND_NA = "n/a: not run ({why})"
LEGEND_GAPS = {"gloo": "gloo has no all_to_all of objects",
               "star": "star runs only all_reduce of a few ints"}


def legend(systems: Sequence[str], na: Sequence[str]) -> str:
    """The table's legend: its columns, and why a cell is n/a where one is (``na``: the
    systems with such cells)."""
    parts = [LEGEND_TIMES]
    if len(systems) > 1:
        parts.append(LEGEND_RATIO.format(base=systems[0]))
    if na:
        why = [LEGEND_GAPS[s] for s in dict.fromkeys(na) if s in LEGEND_GAPS]
        parts.append(LEGEND_NA.format(why="; ".join([
            *why, "or its run failed, as said before the table" if why
            else "its run failed, as said before the table"])))
    return "; ".join(parts)


def table(rows: list[dict[str, Any]], systems: list[str]) -> str:
    """One line per (op, size, world size); one column group per system; a legend."""
    base = systems[0]
    head = f"{'op':<11}{'size':>6}{'N':>4}"
    width = {s: max(12, len(s) + 5) for s in systems}  # (a long name widens its column)
    for s in systems:
        head += f" | {s + ' med':>{width[s]}}{'p99':>10}{'cpu':>10}"
        if s != base:
            head += f"{'x':>8}"
    lines = [head, "-" * len(head)]
    index = {(r["system"], r["op"], r["size"], r["world_size"]): r for r in rows}
    keys = sorted({(r["op"], r["size"], r["world_size"]) for r in rows},
                  key=lambda k: (DEFAULT_OPS.index(k[0]) if k[0] in DEFAULT_OPS else 99,
                                 k[1], k[2]))
    na: list[str] = []
    for op, size, n in keys:
        line = f"{op:<11}{fmt_size(size) if size else '-':>6}{n:>4}"
        ref = index.get((base, op, size, n))
        for s in systems:
            r = index.get((s, op, size, n))
            if r is None:
                na.append(s)
                line += f" | {'n/a':>{width[s]}}{'':>10}{'':>10}" + \
                    ("" if s == base else f"{'':>8}")
                continue
            line += (f" | {fmt_us(r['median_us']):>{width[s]}}{fmt_us(r['p99_us']):>10}"
                     f"{fmt_us(r['cpu_us']):>10}")
            if s != base:
                line += f"{fmt_ratio(r['median_us'] / ref['median_us']):>8}" if ref \
                    else f"{'-':>8}"
        lines.append(line)
    lines.append(textwrap.fill(legend(systems, na), width=max(len(head), 60)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running


def _bench_child(rank: int, n: int, system: str, cfg: dict[str, Any], q: Any) -> Any:
    # (it runs ignoring SIGINT: Ctrl-C is the bench's to handle, which stops its ranks by
    # pid; else each would print a KeyboardInterrupt traceback)
    def progress(op: str, size: int) -> None:
        if rank == 0 and q is not None:
            q.put(("progress", op, size))

    return _system(system)(rank, n, cfg, progress)


class _Progress:
    """The bar on ``stream``: redrawn in place (``\\r``) on a terminal; elsewhere (a log file,
    a pipe, CI) a line at each tenth of the way and at the end, not a redraw per step."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total, self.done, self.stream = total, 0, stream
        try:
            self.tty = bool(stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self.tty = False
        self.shown = 0  # (not a terminal) tenths of the way already written

    def step(self, label: str) -> None:
        """One more (op, size) of a system has finished: ``label`` names it."""
        self.done += 1
        total = max(self.total, 1)
        if self.tty:
            width = 30
            filled = int(width * min(self.done, total) / total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] "
                              f"{self.done}/{self.total} done: {label:<40}")
        else:
            tenth = min(self.done, total) * 10 // total
            if tenth <= self.shown and self.done != self.total:
                return
            self.shown = tenth
            self.stream.write(f"bench: {self.done}/{self.total} done (last: {label.strip()})\n")
        self.stream.flush()

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def each_rank_failure(e: Exception) -> str:
    """A failed run, a line (or a message's lines) per rank that failed: what each raised,
    without the traceback, which shows the bench's code and not what went wrong."""
    failures = getattr(e, "failures", None)
    if not failures:
        return str(e)
    return "\n".join(f"  rank {r}: " + text.split("\nTraceback (most recent call last):")[0]
                     .strip() for r, text in sorted(failures.items()))


def run_local(world_sizes: list[int], systems: list[str], cfg: dict[str, Any],
              stream: Any = sys.stderr, failed: dict[tuple[str, int], str] | None = None
              ) -> list[dict[str, Any]]:
    """Spawn each world size locally on loopback and run each system; returns flat rows.

    A system whose run fails (a rank raises or dies: the others are stopped at once) is left
    out at that world size, with a message on ``stream``, and recorded in ``failed``."""
    check_cfg(cfg)
    bad = [n for n in world_sizes if type(n) is not int or n < 1]
    if bad or not world_sizes:
        raise ValueError(f"world sizes must be integers >= 1, got {bad or world_sizes}")
    world_sizes = list(dict.fromkeys(world_sizes))
    # each world size's own settings: the ops it can run
    cfgs = {n: dict(cfg, ops=ops_at(cfg["ops"], n, stream)) for n in world_sizes}
    repeat = max(int(cfg.get("repeat", 1)), 1)
    bar = _Progress(sum(len(op_sizes(c["ops"], c["sizes"])) for c in cfgs.values())
                    * len(systems) * repeat, stream)
    run = _LocalRun(cfgs, bar, {} if failed is None else failed, stream)
    rows = []
    for n in world_sizes:
        if cfgs[n]["ops"]:
            rows += run.world(n, systems, repeat)
    bar.end()
    return rows


class _LocalRun:
    """The runs of :func:`run_local`, one world size at a time."""

    def __init__(self, cfgs: dict[int, dict[str, Any]], bar: _Progress,
                 failed: dict[tuple[str, int], str], stream: Any) -> None:
        import multiprocessing as mp

        self.cfgs, self.bar, self.failed, self.stream = cfgs, bar, failed, stream
        self.ctx = mp.get_context("spawn")

    def world(self, n: int, systems: list[str], repeat: int) -> list[dict[str, Any]]:
        """The rows of world size ``n``. With repeat, the systems take turns (a, b, c, a,
        b, c, ...) and each one's samples are pooled: a slow spell of a shared machine then
        falls on every system alike."""
        from ..testing import RankFailedError

        got: dict[str, list[Results]] = {}
        each: dict[str, list[dict[tuple[str, int], dict[str, Any]]]] = {s: [] for s in systems}
        for _ in range(repeat):
            for system in systems:
                if (system, n) in self.failed:  # (in an earlier turn)
                    for _ in op_sizes(self.cfgs[n]["ops"], self.cfgs[n]["sizes"]):
                        self.bar.step(f"{system} N={n} left out")
                    continue
                try:
                    with one_thread_pools():  # the ranks' environment
                        per_rank = self._mpi(n) if system == "mpi" else self._ranks(n, system)
                except RankFailedError as e:
                    # the others' figures are still worth a table: this one is left out
                    self.failed[(system, n)] = why = each_rank_failure(e)
                    self.stream.write(f"\n{system} at {n} ranks failed (left out):\n{why}\n")
                    got.pop(system, None)
                    continue
                each[system].append(summarize(per_rank))
                got[system] = per_rank if system not in got else merge(got[system], per_rank)
        return _rows(n, systems, got, each, repeat)

    def _mpi(self, n: int) -> list[Results]:
        from ..testing import RankFailedError
        from ._baselines import run_mpi

        plan = op_sizes(self.cfgs[n]["ops"], self.cfgs[n]["sizes"])
        try:
            per_rank = run_mpi(n, self.cfgs[n])
        except (OSError, ValueError, TypeError, subprocess.SubprocessError) as e:
            for _ in plan:  # (the bar ends full, also where a run failed)
                self.bar.step(f"mpi N={n} failed")
            raise RankFailedError(f"mpiexec: {type(e).__name__}: {e}", {}) from e
        for op, size in plan:
            self.bar.step(f"mpi N={n} {op} {fmt_size(size) if size else ''}")
        return per_rank

    def _ranks(self, n: int, system: str) -> list[Results]:
        """A run of ``system`` in ``n`` spawned ranks, through a store of this process; the
        ranks report each op's end through a queue, which a thread turns into the bar's
        steps."""
        import threading

        from ..rendezvous._server import StoreServer
        from ..testing import run_ranks

        ncfg = self.cfgs[n]
        plan = op_sizes(ncfg["ops"], ncfg["sizes"])
        q = self.ctx.Queue()
        stop = threading.Event()
        stepped = [0]

        def pump() -> None:
            while not stop.is_set():
                try:
                    _, op, size = q.get(timeout=0.1)
                except Exception:
                    continue
                stepped[0] += 1
                self.bar.step(f"{system} N={n} {op} {fmt_size(size) if size else ''}")

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        with StoreServer("127.0.0.1", 0, auth_key=env_key()) as srv:
            c = dict(ncfg, host="127.0.0.1", port=srv.port, host_store=False,
                     tag=f"{system}{n}")
            ok, interrupted = False, True
            try:
                per_rank = run_ranks(_bench_child, n, system, c, q, ignore_sigint=True,
                                     timeout=ncfg.get("timeout", 900), fail_fast=True)
                ok, interrupted = True, False
            except Exception:
                interrupted = False
                raise
            finally:
                stop.set()
                th.join()
                # the ops this system does not offer (gloo: all_to_all; star: all but a
                # small all_reduce), progress reports still queued, and what a failed run
                # left undone: the bar ends full (not where Ctrl-C or a signal ended the
                # bench: nothing more was done, nor did it fail)
                for _ in range(0 if interrupted else len(plan) - stepped[0]):
                    self.bar.step(f"{system} N={n} {'done' if ok else 'failed'}")
            return per_rank


def _rows(n: int, systems: Sequence[str], got: Mapping[str, list[Results]],
          each: Mapping[str, list[Results]], repeat: int) -> list[dict[str, Any]]:
    """The table rows of world size ``n``: per system that ran (``got``: its pooled figures,
    one entry per rank; ``each``: each turn's summary), per (op, size)."""
    rows = []
    for system in systems:
        if system not in got:
            continue
        for (op, size), fig in summarize(got[system]).items():
            row = {"system": system, "op": op, "size": size, "world_size": n, **fig}
            if repeat > 1:
                # each run's own median: how far a slow spell of the machine moved it
                row["repeat_median_us"] = [r[(op, size)]["median_us"] for r in each[system]]
            rows.append(row)
    return rows


SETTINGS = ("ops", "sizes", "iters", "warmup", "aio", "repeat", "transport")
MULTIHOST_WAIT_S = 300.0  # how long the ranks of a multi-host run wait for each other


def run_multihost(host: str, port: int, rank: int, n: int, cfg: dict[str, Any],
                  stream: Any = sys.stderr) -> list[dict[str, Any]] | None:
    """Run this rank of a multi-host ctrlcomm benchmark; rank 0 returns the rows.

    Rank 0 serves the store at ``(host, port)`` for the whole run. The ranks first compare
    their settings (ValueError naming the ranks and settings that differ: they would wait
    for each other in different calls); per-rank figures travel to rank 0 through a ctrlcomm
    group of their own. Rank 0 shows a progress bar on ``stream``.
    """
    from .._group import Group
    from ..rendezvous._client import _store_host
    from ..rendezvous._server import StoreServer

    check_cfg(cfg)
    if type(n) is not int or n < 1 or type(rank) is not int or not 0 <= rank < n:
        raise ValueError(f"rank {rank!r} of world size {n!r}: the world size must be >= 1 "
                         "and the rank in [0, world size)")
    # (StoreError naming a host that does not resolve; a name is looked up once, within
    # the ranks' wait)
    host = _store_host(host, port, MULTIHOST_WAIT_S)
    systems = ("ctrlcomm", "ctrlcomm-aio") if cfg.get("aio") else ("ctrlcomm",)
    repeat = max(int(cfg.get("repeat", 1)), 1)
    run_cfg = dict(cfg, ops=ops_at(cfg["ops"], n, stream if rank == 0 else None))
    plan = op_sizes(run_cfg["ops"], run_cfg["sizes"])
    bar = _Progress(len(plan) * len(systems) * repeat, stream) if rank == 0 else None

    def group(name: str) -> Any:
        return Group.create(host, port, rank, n, name=name, host_store=False,
                            timeout=MULTIHOST_WAIT_S)

    srv = StoreServer(host, port, auth_key=env_key()) if rank == 0 else None
    try:
        mine = {k: cfg.get(k) for k in SETTINGS}
        if stream is not None:  # (the ranks may be started by hand, one by one: say so)
            stream.write(f"rank {rank} of {n}: waiting for the other ranks at {host}:{port} "
                         f"(at most {MULTIHOST_WAIT_S:g} s)\n")
            stream.flush()
        with group("bench-settings") as g:
            everyone = g.all_gather(mine)
        differ = {r: {k: v for k, v in c.items() if v != mine[k]}
                  for r, c in enumerate(everyone) if c != mine}
        if differ:
            raise ValueError(
                f"the ranks run different settings (rank {rank}: "
                + ", ".join(f"{k}={v!r}" for k, v in mine.items()) + "); "
                + "; ".join(f"rank {r}: " + ", ".join(f"{k}={v!r}" for k, v in d.items())
                            for r, d in differ.items())
                + ": start every rank with the same options")
        got: dict[str, list[Results]] = {}  # each system's figures, one entry per rank
        each: dict[str, list[Results]] = {s: [] for s in systems}
        for i in range(repeat):
            for system in systems:
                c = dict(run_cfg, host=host, port=port, host_store=False, tag=f"{system}-{i}")

                def progress(op: str, size: int, system: str = system) -> None:
                    if bar is not None:
                        bar.step(f"{system} N={n} {op} {fmt_size(size) if size else ''}")

                with one_thread_pools():  # this process is the rank: its own environment
                    r = SYSTEMS[system](rank, n, c, progress)
                with group(f"results-{system}-{i}") as g:
                    all_ranks = g.gather(r, dst=0)
                if all_ranks is not None:
                    each[system].append(summarize(all_ranks))
                    got[system] = all_ranks if system not in got \
                        else merge(got[system], all_ranks)
        if bar is not None:
            bar.end()
    finally:
        if srv is not None:
            srv.close()
    return _rows(n, systems, got, each, repeat) if rank == 0 else None


# One colour per system, whatever the order of --against (a plot compares with another)
COLORS = {"ctrlcomm": "#1f77b4", "ctrlcomm-aio": "#17becf", "gloo": "#d62728",
          "mpi": "#2ca02c", "store": "#9467bd", "star": "#ff7f0e", "ctrlcomm-nohb": "#8c564b",
          "ctrlcomm-hb10ms": "#e377c2", "vllm": "#bcbd22"}
OTHER_COLOR = "#7f7f7f"


def plot_title(cfg: Mapping[str, Any] | None) -> str:
    """The plot's title: what it shows, and the machine and date of the run."""
    head = "ctrlcomm bench: median latency per call (bars: up to the p99)"
    if not cfg:
        return head
    host = cfg.get("host")
    h: Mapping[str, Any] = host if isinstance(host, dict) else {}
    machine = ", ".join(str(x) for x in (h.get("cpu"), f"{cfg.get('cpus', '?')} CPUs",
                                         h.get("kernel"), f"Python {cfg.get('python', '?')}")
                        if x)
    when = str(cfg.get("when", "")).replace("T", " ")
    return f"{head}\n{machine}; {when}" if when else f"{head}\n{machine}"


def plot(path: str, rows: list[dict[str, Any]], cfg: Mapping[str, Any] | None = None) -> None:
    """Latency against world size (small payloads) and against payload size (largest world),
    one line per system (its median, and a bar up to its p99), each in its own colour; the
    title says the machine and date of the run (``cfg``: the run's settings)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    color = {name: COLORS.get(name, OTHER_COLOR) for name in systems}
    ops = [o for o in DEFAULT_OPS if any(r["op"] == o for r in rows)]
    sizes = sorted({r["size"] for r in rows if r["size"]})
    small = min(sizes) if sizes else 0
    worlds = sorted({r["world_size"] for r in rows})
    sized = [o for o in ops if len({r["size"] for r in rows if r["op"] == o}) > 1]
    panels = len(ops) + len(sized)
    cols = 4
    nrows = (panels + cols - 1) // cols
    head = 0.85  # inches above the panels: the title (two lines) and the legend
    height = 3.4 * nrows + head
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, height), squeeze=False)
    flat = [a for row in axes for a in row]
    for ax, op in zip(flat, ops, strict=False):
        for sysname in systems:
            pts = sorted((r["world_size"], r["median_us"], r["p99_us"]) for r in rows
                         if r["system"] == sysname and r["op"] == op
                         and r["size"] in (0, small))
            _line(ax, pts, sysname, color[sysname])
        ax.set_title(f"{op} ({fmt_size(small) if op in SIZED_OPS else '-'}) vs world size")
        ax.set_xlabel("ranks")
        ax.set_ylabel("median latency (us)")
        ax.set_yscale("log")
        ax.set_xticks(worlds)
    for ax, op in zip(flat[len(ops):], sized, strict=False):
        n = max(worlds)
        for sysname in systems:
            pts = sorted((r["size"], r["median_us"], r["p99_us"]) for r in rows
                         if r["system"] == sysname and r["op"] == op and r["world_size"] == n)
            _line(ax, pts, sysname, color[sysname])
        ax.set_title(f"{op} vs payload size (N={n})")
        ax.set_xlabel("bytes")
        ax.set_ylabel("median latency (us)")
        ax.set_xscale("log")
        ax.set_yscale("log")
    for ax in flat[panels:]:
        ax.axis("off")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color[name], marker="o", label=name) for name in systems]
    fig.suptitle(plot_title(cfg), fontsize=10, y=1 - 0.05 / height, va="top")
    fig.legend(handles=handles, loc="upper center", ncol=len(systems), fontsize=9,
               bbox_to_anchor=(0.5, 1 - 0.42 / height), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - head / height))
    ext = os.path.splitext(path)[1][1:].lower()
    fig.savefig(path, dpi=110, format=ext or "png")  # (no extension: a PNG, at that path)


def _line(ax: Any, pts: list[tuple[float, float, float]], name: str, color: str) -> None:
    """One system's line on ``ax``: (x, median, p99) points, the median drawn, a bar from it
    up to the p99 at each point (the spread; a band would vanish where a run has one x)."""
    if not pts:
        return
    xs, med, p99 = zip(*pts, strict=True)
    ax.errorbar(xs, med, yerr=[[0.0] * len(med), [p - m for m, p in zip(med, p99, strict=True)]],
                marker="o", label=name, color=color, capsize=3, elinewidth=1)


def check_plot(path: str) -> None:
    """Raise before a run what :func:`plot` would raise after it: ImportError without
    matplotlib, ValueError for a file type it cannot write."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ext = os.path.splitext(path)[1][1:].lower()
    # (pgf needs a LaTeX installation)
    kinds = set(FigureCanvasAgg(Figure()).get_supported_filetypes()) - {"pgf"}
    if ext and ext not in kinds:
        raise ValueError(f"matplotlib cannot write .{ext} files (it writes "
                         f"{', '.join('.' + k for k in sorted(kinds))})")


def read_run(path: str) -> tuple[list[dict[str, Any]], dict[str, Any],
                                  dict[tuple[str, int], str]]:
    """A run that :func:`write_json` wrote, read once: its rows, its settings, and the systems
    whose runs failed, ``{(system, world size): why}`` (none in a file from before they were
    written). ValueError for a file whose rows are not a run's."""
    with open(path) as f:
        data = json.load(f)
    rows = data.get("results") if isinstance(data, dict) else None
    need = ("system", "op", "size", "world_size", "median_us", "p99_us", "cpu_us")
    if not isinstance(rows, list) or not rows:
        raise ValueError("no \"results\" list in it")
    for i, r in enumerate(rows):
        lacks = [k for k in need if not isinstance(r, dict) or k not in r]
        if lacks:
            raise ValueError(f"results[{i}] lacks {', '.join(lacks)}")
        bad = [k for k, ok in (
            ("system", isinstance(r["system"], str)), ("op", r["op"] in DEFAULT_OPS),
            ("size", type(r["size"]) is int and r["size"] >= 0),
            ("world_size", type(r["world_size"]) is int and r["world_size"] >= 1),
            *((k, type(r[k]) in (int, float) and r[k] >= 0 and r[k] == r[k]
               and (k != "median_us" or r[k] > 0)) for k in ("median_us", "p99_us", "cpu_us")),
        ) if not ok]
        if bad:
            raise ValueError(f"results[{i}] has a bad " + ", ".join(
                f"{k} ({r[k]!r})" for k in bad))
    cfg = data.get("config")
    failed = {}
    for item in data.get("failed") or ():
        if isinstance(item, dict) and isinstance(item.get("system"), str) \
                and type(item.get("world_size")) is int:
            failed[(item["system"], item["world_size"])] = str(item.get("why", ""))
    return rows, cfg if isinstance(cfg, dict) else {}, failed


# environment variables that change what ctrlcomm runs (recorded with a run: see record_host;
# the key's value never, only that one is set: it makes every message carry a MAC)
CHOICE_ENV = ("CTRLCOMM_ALGO", "CTRLCOMM_SMALL_WORLD", "CTRLCOMM_LOCAL_SOCKETS", "CTRLCOMM_SPIN_US",
              "CTRLCOMM_LIVENESS_TIMEOUT", "CTRLCOMM_AUTH_KEY")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def loop_us() -> float:
    """How fast this Python runs here, now: ``sum(range(1000))`` in microseconds, best of 5."""
    import timeit

    return round(min(timeit.repeat("sum(range(1000))", repeat=5, number=200)) / 200 * 1e6, 2)


def record_host(cfg: dict[str, Any]) -> None:
    """Record in ``cfg`` (for the JSON) what decides a run's figures besides its settings, so
    that runs on different machines can be told apart: Python, CPUs, the kernel, the CPU
    model, the environment variables that change ctrlcomm's choices (:data:`CHOICE_ENV`),
    and how fast this Python runs a fixed loop (:func:`loop_us`) before the run; call
    :func:`record_speed_after` after it. Machines of one kind have differed by 2x in that
    loop, and one machine by as much from minute to minute (a shared host): ctrlcomm's CPU
    per call, Python, follows it; the C++ store and MPI baselines much less."""
    import platform

    cfg.setdefault("python", sys.version.split()[0])
    cfg.setdefault("cpus", os.cpu_count())
    cfg.setdefault("when", time.strftime("%Y-%m-%dT%H:%M:%S"))
    cfg["versions"] = versions()
    cfg["host"] = {"kernel": f"{platform.system()} {platform.release()}", "cpu": _cpu_model(),
                   "env": {k: "(set)" if k == "CTRLCOMM_AUTH_KEY" else os.environ[k]
                           for k in CHOICE_ENV if os.environ.get(k)},
                   "sum_range_1000_us": [loop_us()]}


def versions() -> dict[str, str]:
    """The versions of what decides a run's figures: ctrlcomm (and its git commit where it
    runs from a checkout), Python's ZeroMQ, and the baselines' libraries where installed."""
    import importlib.metadata as md

    from .. import __version__

    out = {"ctrlcomm": __version__}
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5)
        if commit.returncode == 0 and commit.stdout.strip():
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", here],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            out["ctrlcomm_commit"] = commit.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    for dist in ("pyzmq", "torch", "mpi4py", "mpich", "numpy", "msgpack"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        import zmq

        out["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    return out


def record_speed_after(cfg: dict[str, Any]) -> None:
    speeds = cfg.get("host", {}).get("sum_range_1000_us")
    if isinstance(speeds, list) and len(speeds) == 1:
        speeds.append(loop_us())


def describe_host(cfg: Mapping[str, Any]) -> str:
    """One line on the machine a run ran on ("" for a saved run that did not record it)."""
    h = cfg.get("host")
    if not isinstance(h, dict):
        return ""
    env = h.get("env")
    speeds = h.get("sum_range_1000_us")
    speed = " and ".join(map(str, speeds)) if isinstance(speeds, list) else speeds
    return (f"ran on: {h.get('kernel', '?')}, {h.get('cpu', '?')}, {cfg.get('cpus', '?')} "
            f"CPUs, Python {cfg.get('python', '?')}; sum(range(1000)) took {speed} us "
            "(before and after the run)"
            + ("; " + " ".join(f"{k}={v}" for k, v in env.items())
               if isinstance(env, dict) and env else ""))


def write_json(path: str, rows: list[dict[str, Any]], cfg: dict[str, Any],
               failed: Mapping[tuple[str, int], str] | None = None) -> None:
    # (python, cpus, when and host: a saved run's, shown again, are kept as they were)
    meta = {k: v for k, v in cfg.items()
            if k in SETTINGS + ("world_sizes", "against", "python", "cpus", "when", "host",
                                "command", "versions", "multihost")}
    meta.setdefault("python", sys.version.split()[0])
    meta.setdefault("cpus", os.cpu_count())
    meta.setdefault("when", time.strftime("%Y-%m-%dT%H:%M:%S"))
    lost = [{"system": sys_, "world_size": n, "why": why}
            for (sys_, n), why in (failed or {}).items()]
    with open(path, "w") as f:
        json.dump({"config": meta, "results": rows, "failed": lost}, f, indent=1)
