"""``ctrlcomm bench``'s command line: its options, their checks, and the run they start."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from . import _measure as m
from ._measure import DEFAULT_OPS


def _int_in(least: int, most: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``least`` (to ``most``), else an error naming it."""
    want = what or (f"an integer >= {least}" if most is None else f"an integer {least}-{most}")

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = least - 1
        if v < least or (most is not None and v > most):
            raise argparse.ArgumentTypeError(f"{want}, got {text!r}")
        return v
    return parse


def _port_from(least: int) -> Callable[[str], int]:
    return _int_in(least, 65535, f"a TCP port ({least}-65535)")


def _listed(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"a comma-separated list, got {text!r}")
        return [item(t) for t in parts]
    return parse


def _size(text: str) -> int:
    from ._measure import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# the run settings of `ctrlcomm bench` and their defaults (None in the parser: so that what
# was given can be told from what was not)
BENCH_DEFAULTS: dict[str, Any] = {
    "ops": ",".join(DEFAULT_OPS),
    "sizes": [8], "iters": 1000, "warmup": 100, "repeat": 1, "transport": "shm"}
RUN_OPTIONS = {"n": "-n", "ops": "--ops", "sizes": "--sizes", "iters": "--iters",
               "warmup": "--warmup", "repeat": "--repeat", "aio": "--aio",
               "against": "--against", "transport": "--transport", "host": "--host",
               "port": "--port", "rank": "--rank", "world_size": "--world-size"}


def _multihost(args: argparse.Namespace) -> bool:
    """Whether the bench runs one rank of a multi-host run (any of its four options)."""
    return any(v is not None for v in (args.host, args.port, args.rank, args.world_size))


def _runnable(b: Any, cfg: dict[str, Any], world_sizes: list[int]) -> bool:
    """Whether the run can go: some op can run at some of the world sizes, and no payload
    is more than its messages carry; if not, says why."""
    if not any(m.ops_at(cfg["ops"], n) for n in world_sizes):
        print(f"nothing to run: {', '.join(cfg['ops'])} needs 2 ranks, and the world size is "
              f"{', '.join(map(str, world_sizes))}", file=sys.stderr)
        return False
    why = b.too_large(cfg["ops"], cfg["sizes"], world_sizes)
    if why:
        print(f"ctrlcomm bench: {why}", file=sys.stderr)
        return False
    return True


def _writable(path: str) -> bool:
    """Whether a file can be written at ``path``. A new one is tried (created exclusively,
    not through a link, and removed again): permissions do not tell (root may write anywhere
    they say, and /proc refuses new files whatever they say). What is there already (a file,
    a named pipe, a link) is not opened: its permissions are asked."""
    if os.path.isdir(path):
        return False
    if os.path.lexists(path):
        return os.access(path, os.W_OK)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    os.close(fd)
    try:
        os.unlink(path)
    except OSError:
        pass
    return True


class _Stop(Exception):
    """Ends ``ctrlcomm bench`` with exit ``code``, ``message`` said on standard error."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _bench(args: argparse.Namespace) -> int:
    try:
        return _bench_or_stop(args)
    except _Stop as e:
        if e.message:
            print(e.message, file=sys.stderr)
        return e.code


def _formation(args: argparse.Namespace) -> int:
    """``ctrlcomm bench --formation``."""
    import json

    from . import _formation as f

    others = [x for x in RUN_OPTIONS if x not in ("n", "repeat", "against")
              and getattr(args, x) not in (None, False)]
    if others or args.plot or args.from_json:
        raise _Stop(2, "--formation takes -n, --repeat, --against and --json only")
    text = "gloo,vllm" if args.against is None else _against(args)
    asked = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in asked if s not in f.SYSTEMS[1:]]
    if unknown:
        raise _Stop(2, f"--formation --against: {', '.join(unknown)}: use gloo, vllm")
    systems = ["ctrlcomm", *f.available(asked)]
    missing = [s for s in asked if s not in systems]
    if missing:
        print(f"not installed, not compared: {', '.join(missing)}", file=sys.stderr)
    sizes = args.n or [16, 64, 256]
    print(f"formation, from every process ready to every group formed ({args.repeat or 1} "
          "each):", flush=True)
    rows = f.run(sizes, systems, args.repeat or 1)
    print(f.table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"formation": rows}, out, indent=1)
    return 0


def _bench_or_stop(args: argparse.Namespace) -> int:
    from . import _run as b

    if args.formation:
        return _formation(args)

    _check_settings(args)
    cfg = _config(args)
    multihost = _multihost(args)
    systems = ["ctrlcomm"] + (["ctrlcomm-aio"] if args.aio else [])
    failed: dict[tuple[str, int], str] = {}  # (system, world size): why its run failed
    rows: list[dict[str, Any]] | None
    _check_outputs(args, writes=not multihost or args.rank == 0)
    if args.from_json:
        rows, cfg, systems = _saved_run(args, failed)
    elif multihost:
        rows = _multihost_rank(args, cfg)
    else:
        rows = _local_run(args, cfg, systems, failed)
    if rows is None:  # a multi-host rank other than 0: rank 0 prints
        return 0
    if not rows:
        raise _Stop(1, "nothing ran: every system's run failed")
    if not args.from_json:
        b.record_speed_after(cfg)
    return _report(args, rows, cfg, systems, failed)


def _check_settings(args: argparse.Namespace) -> None:
    from .._algo import setting_problems

    problems = setting_problems()
    if problems and not args.from_json:  # (a run would say it used them)
        # (a library call warns and runs its default; a bench run would record the setting)
        raise _Stop(2, "ctrlcomm bench: refused: " + "; ".join(p.removesuffix(" (ignored)")
                                                                for p in problems)
                    + " (fix or unset it)")
    if args.from_json:
        given = [o for k, o in RUN_OPTIONS.items()
                 if getattr(args, k) is not None and getattr(args, k) is not False]
        if given:
            raise _Stop(2, f"--from-json shows a saved run and runs nothing: {' '.join(given)} "
                           "do not go with it")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings, the defaults filled in, checked."""
    from . import _run as b

    for k, v in BENCH_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    cfg = {"ops": [o.strip() for o in args.ops.split(",") if o.strip()], "sizes": args.sizes,
           "iters": args.iters, "warmup": args.warmup, "aio": args.aio,
           "transport": args.transport, "repeat": args.repeat}
    if not args.from_json:  # (a saved run keeps its own)
        cfg["command"] = shlex.join(["ctrlcomm", "bench", *getattr(args, "argv", [])])
    small = [z for z in dict.fromkeys(args.sizes) if z <= m.SMALL]
    if len(small) > 1 and not args.from_json:
        keep = 8 if 8 in small else small[0]  # (8: the size the reference runs show)
        if m.SIZED_OPS.intersection(cfg["ops"]):
            print(f"--sizes {', '.join(map(str, small))}: up to {m.SMALL} bytes every size "
                  f"sends the same small object; running {keep} only", file=sys.stderr)
        cfg["sizes"] = [z for z in args.sizes if z > m.SMALL or z == keep]
    try:
        b.check_cfg(cfg)
    except ValueError as e:
        raise _Stop(2, f"ctrlcomm bench: {e}") from None
    return cfg


def _check_outputs(args: argparse.Namespace, writes: bool) -> None:
    """--json and --plot, found out before the run, not after it (by the rank that writes
    them)."""
    from . import _run as b

    if writes and args.json and args.plot and os.path.abspath(args.json) == \
            os.path.abspath(args.plot):
        raise _Stop(2, f"--json and --plot name the same file ({args.json}): one would "
                       "overwrite the other")
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.strip():  # (`--json "$OUT"` with OUT unset)
            raise _Stop(2, f"{opt}: the file name is empty")
    for opt, path in (("--json", args.json), ("--plot", args.plot)) if writes else ():
        if path and not _writable(path):
            raise _Stop(2, f"{opt} {path}: cannot write there (a folder, no such folder, or "
                           "not writable)")
    if args.plot and writes:
        try:
            b.check_plot(args.plot)
        except ImportError:
            raise _Stop(2, "--plot needs matplotlib: pip install 'ctrlcomm[plot]'") from None
        except ValueError as e:
            raise _Stop(2, f"--plot {args.plot}: {e}") from None


def _saved_run(args: argparse.Namespace, failed: dict[tuple[str, int], str]
               ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """A run read back (--from-json): its rows, settings and systems."""
    from . import _run as b

    try:
        rows, cfg, saved_failed = b.read_run(args.from_json)  # (cfg: what --json writes)
        failed.update(saved_failed)
        # the columns in the run's order (ctrlcomm, the base of the ratios, first), then
        # any other system the file holds
        held = list(dict.fromkeys([r["system"] for r in rows] + [s for s, _ in failed]))
        against: list[str] = cfg["against"] if isinstance(cfg.get("against"), list) else []
        order = ["ctrlcomm", *(["ctrlcomm-aio"] if cfg.get("aio") else []), *against]
        systems = [s for s in dict.fromkeys(order) if s in held]
        systems += [s for s in held if s not in systems]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Stop(2, f"--from-json {args.from_json}: " + (
            f"cannot read it ({e.strerror})" if isinstance(e, OSError) and e.strerror
            else f"not the results of a bench run ({type(e).__name__}: {e})")) from None
    return rows, cfg, systems


def _multihost_rank(args: argparse.Namespace, cfg: dict[str, Any]
                    ) -> list[dict[str, Any]] | None:
    """One rank of a multi-host run (any of the four options: never a local run instead)."""
    from .._errors import CtrlcommError
    from . import _run as b

    absent = [o for o, v in (("--host", args.host), ("--port", args.port),
                             ("--rank", args.rank), ("--world-size", args.world_size))
              if v is None]
    if absent:
        raise _Stop(2, "multi-host mode needs --host, --port, --rank and --world-size "
                       f"(missing: {' '.join(absent)})")
    if args.n is not None:
        raise _Stop(2, "-n runs local ranks; it does not go with --host, --port, --rank and "
                       "--world-size (one rank of a multi-host run)")
    if args.rank >= args.world_size:
        raise _Stop(2, f"--rank {args.rank} is not a rank of --world-size {args.world_size} "
                       f"(0 to {args.world_size - 1})")
    if args.against:  # (refused, not ignored: the run would compare nothing)
        raise _Stop(2, "--against runs only with local ranks (-n), not in a multi-host run")
    if args.rank != 0 and (args.json or args.plot):
        print("--json and --plot are written by rank 0; ignoring them here", file=sys.stderr)
    if not _runnable(b, cfg, [args.world_size]):
        raise _Stop(2)
    if args.rank == 0:  # (the rank that reports)
        b.record_host(cfg)
        cfg["multihost"] = {"host": args.host, "port": args.port,
                            "world_size": args.world_size}
    try:
        rows = b.run_multihost(args.host, args.port, args.rank, args.world_size, cfg)
    except ValueError as e:  # the ranks were started with different settings
        raise _Stop(2, f"\nctrlcomm bench: {e}") from None
    except (CtrlcommError, OSError) as e:  # the port is taken, a host not found, a rank
        # never came or failed...
        raise _Stop(1, f"\nctrlcomm bench (rank {args.rank}): {type(e).__name__}: {e}"
                    ) from None
    cfg["world_sizes"] = [args.world_size]
    return rows


def _local_run(args: argparse.Namespace, cfg: dict[str, Any], systems: list[str],
               failed: dict[tuple[str, int], str]) -> list[dict[str, Any]]:
    """A run of local ranks (-n), with the systems --against names added to ``systems``."""
    from . import _run as b

    _add_against(args, cfg, systems)
    cfg["world_sizes"] = list(dict.fromkeys(args.n or [2, 4]))
    if not _runnable(b, cfg, cfg["world_sizes"]):
        raise _Stop(2)
    cpus = os.cpu_count() or 1
    if max(cfg["world_sizes"]) > 8 * cpus:
        print(f"note: {max(cfg['world_sizes'])} ranks on {cpus} CPUs: starting them alone "
              "takes a while, and the figures measure the CPUs' sharing", file=sys.stderr)
    cfg["against"] = systems[1 + bool(args.aio):]
    b.record_host(cfg)
    return b.run_local(cfg["world_sizes"], systems, cfg, failed=failed)


def _against(args: argparse.Namespace) -> str:
    """The systems to compare with: ``--against``'s (``none``: none), else those installed:
    gloo where torch imports, MPI where mpi4py and an MPI do."""
    from ._baselines import missing

    if args.against is not None:
        return "" if args.against.strip() == "none" else str(args.against)
    return ",".join(s for s in ("gloo", "mpi") if missing(s) is None)


def _add_against(args: argparse.Namespace, cfg: dict[str, Any], systems: list[str]) -> None:
    from ._baselines import missing

    known = ("gloo", "mpi", "store", "star", "ctrlcomm-nohb", "ctrlcomm-hb10ms")
    against = _against(args)
    for other in [a.strip() for a in against.split(",") if a.strip()]:
        if other not in known:
            raise _Stop(2, f"unknown system {other!r} in --against ({', '.join(known)})")
        why = missing(other)
        if why:
            print(f"skipping {other}: {why}", file=sys.stderr)
        elif other not in systems:
            systems.append(other)
    star_runs = any(op == "all_reduce" and z <= m.SMALL
                    for op, z in m.op_sizes(cfg["ops"], cfg["sizes"]))
    if args.against and "star" not in systems and "gloo" in systems \
            and missing("star") is None and star_runs:
        systems.append("star")  # all_reduce against Megatron's original design too
    if "star" in systems and not star_runs:  # (asked for by name)
        print("skipping star: it runs only all_reduce of a few ints (a size up to "
              f"{m.SMALL} bytes), and these ops and sizes have none", file=sys.stderr)
        systems.remove("star")


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], cfg: dict[str, Any],
            systems: list[str], failed: dict[tuple[str, int], str]) -> int:
    """Write the files, then print the table: the exit code."""
    from . import _run as b

    # ctrlcomm stays the first column, the base of the ratios, even where its run failed
    shown = systems[:1] + [s for s in systems[1:] if any(r["system"] == s for r in rows)]
    # the files first: what the run measured is kept whatever becomes of standard output
    # (a pipe closed by `| head`, a full disk)
    wrote, code = [], 0
    if args.json:
        try:
            b.write_json(args.json, rows, cfg, failed)
            wrote.append(args.json)
        except OSError as e:
            print(f"--json {args.json}: {e}", file=sys.stderr)
            code = 1
    if args.plot:
        try:
            b.plot(args.plot, rows, cfg)
            wrote.append(args.plot)
        except OSError as e:  # (a full disk: the table is still worth printing)
            print(f"--plot {args.plot}: {e}", file=sys.stderr)
            code = 1
    ran_on = b.describe_host(cfg)
    _say(b.table(rows, shown), *([ran_on] if ran_on else []), *(f"wrote {f}" for f in wrote))
    if failed:
        print("left out, their runs failed: " + ", ".join(f"{s} at {n} ranks"
                                                          for s, n in failed), file=sys.stderr)
        return code or (0 if args.from_json else 1)  # (a saved run shown again: as it was)
    return code


def _say(*lines: str) -> None:
    """Print ``lines``; where standard output is gone (a closed pipe, a full disk), say so
    once on standard error instead of a traceback (the files are written already)."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except OSError as e:
        try:  # (and no second error as Python flushes it at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        try:
            print(f"ctrlcomm bench: could not print the table ({e.strerror or e})",
                  file=sys.stderr)
        except OSError:
            pass


def _bench_main(args: argparse.Namespace) -> int:
    """:func:`_bench`, ended cleanly by SIGTERM and SIGHUP as by Ctrl-C: the ranks (and mpiexec) it
    started are stopped (by pid, in the runner's cleanup) and it exits with 128 + the
    signal's number, as a shell reports a process the signal ended (130 for Ctrl-C, 143
    for SIGTERM)."""
    got: list[int] = []

    def on_term(signum: int, frame: Any) -> None:
        got.append(signum)
        raise KeyboardInterrupt

    # (SIGHUP too: the terminal or ssh session the bench ran in closed)
    ends = [signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    old = {sig: signal.signal(sig, on_term) for sig in ends} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        return _bench(args)
    except KeyboardInterrupt:
        why = ("terminated" if got[0] == signal.SIGTERM else "hung up") if got else "interrupted"
        try:
            print(f"\nctrlcomm bench: {why}"
                  + ("" if _multihost(args) else "; the ranks it started are stopped"),
                  file=sys.stderr)
        except OSError:  # (no terminal left to say it on)
            pass
        return 128 + (got[0] if got else signal.SIGINT)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def add_bench_parser(sub: Any) -> None:
    """``ctrlcomm bench``'s options, on the command line's subparsers ``sub``."""
    bp = sub.add_parser("bench", help="latency suite (spawns local ranks on loopback)")
    bp.add_argument("-n", type=_listed(_int_in(1)),
                    help="world sizes of local runs, e.g. 2,4,8 (default 2,4)")
    bp.add_argument("--ops", help="the ops to measure, comma-separated (default: all: "
                                  f"{BENCH_DEFAULTS['ops']})")
    bp.add_argument("--sizes", type=_listed(_size),
                    help="payload sizes of the ops that carry data, e.g. 8,1K,64K,1M "
                         "(default 8). Up to 64 bytes every size sends the same small "
                         "object (a dict of three fields; two ints for all_reduce), so one "
                         "such size runs; larger ones send that many bytes (all_reduce: "
                         "size/8 int64s, in a numpy array)")
    bp.add_argument("--iters", type=_int_in(1), help="timed calls per op (default 1000)")
    bp.add_argument("--warmup", type=_int_in(0),
                    help="untimed calls per op before them (default 100)")
    bp.add_argument("--repeat", type=_int_in(1),
                    help="run the systems in turn this many times and pool their samples "
                         "(evens out slow spells of a shared machine; default 1)")
    bp.add_argument("--aio", action="store_true",
                    help="also run the awaited (asyncio) variant, in its own column")
    bp.add_argument("--against", help="compare with: gloo,mpi,store,star (star: all_reduce "
                                      "as Megatron's original; added with gloo); "
                                      "ctrlcomm-nohb, ctrlcomm-hb10ms: ctrlcomm without "
                                      "heartbeats, with one every 10 ms; none: nothing "
                                      "(default: gloo where torch is installed, mpi where "
                                      "mpi4py and an MPI are)")
    bp.add_argument("--plot", help="write a plot (PNG unless the name says another type "
                                   "matplotlib writes; needs matplotlib)")
    bp.add_argument("--from-json", help="show the table (and --plot) of a saved run; run nothing")
    bp.add_argument("--transport", choices=["shm", "tcp", "zmq"], help="ctrlcomm's (default shm)")
    bp.add_argument("--json", help="write results to this file")
    bp.add_argument("--host", help="multi-host run: the address rank 0 serves the store on")
    bp.add_argument("--port", type=_port_from(1), help="multi-host run: the store's port")
    bp.add_argument("--rank", type=_int_in(0), help="multi-host run: this process's rank")
    bp.add_argument("--world-size", type=_int_in(1),
                    help="multi-host run: the number of ranks (one process each, started "
                         "with the same options)")
    bp.add_argument("--formation", action="store_true",
                    help="measure formation instead: from every process ready to every "
                         "group formed, at each -n, against torch's gloo and vLLM's "
                         "StatelessProcessGroup where they import (or --against gloo,vllm); "
                         "--repeat times each, the best shown")
    bp.set_defaults(func=_bench_main)
