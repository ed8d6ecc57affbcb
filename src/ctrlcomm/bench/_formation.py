"""``ctrlcomm bench --formation``: how long a group takes to form, from every process ready
(its imports done, connected to the bench and waiting) to every process holding the group,
for ctrlcomm (``Group.create``), torch's ``init_process_group("gloo")`` and vLLM's
``StatelessProcessGroup.create``, at each world size, in one run.

The processes start as forks of one server that imported every system's modules already
(256 processes that each imported torch would not fit in this machine's memory); each
connects to the bench once ready and waits for a byte. The clock starts as the bench sends
it to all, and stops at the last process's return from formation (one host's clock)."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

SYSTEMS = ("ctrlcomm", "gloo", "vllm")
MODULES = {"ctrlcomm": "ctrlcomm", "gloo": "torch.distributed",
           "vllm": "vllm.distributed.utils"}


def available(systems: Sequence[str]) -> list[str]:
    """Those of ``systems`` whose modules import here."""
    import importlib.util

    out = []
    for s in systems:
        try:
            if importlib.util.find_spec(MODULES[s].split(".")[0]) is not None:
                out.append(s)
        except (ImportError, ValueError):
            pass
    return out


def _form(system: str, rank: int, n: int, port: int) -> Any:
    if system == "ctrlcomm":
        import ctrlcomm

        # (liveness checks off: 256 processes on a few CPUs keep heartbeat threads waiting
        # longer than the default allows; formation does not use them)
        return ctrlcomm.Group.create("127.0.0.1", port, rank, n, name="formation",
                                     timeout=600, liveness_timeout=None)
    if system == "gloo":
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, timeout=timedelta(seconds=600))
        return dist
    from vllm.distributed.utils import StatelessProcessGroup

    return StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank,
                                        world_size=n, store_timeout=600)


def _child(rank: int, n: int, system: str, port: int, go_port: int) -> tuple[float, float]:
    import importlib

    importlib.import_module(MODULES[system])
    with socket.create_connection(("127.0.0.1", go_port), timeout=600) as s:
        s.settimeout(600)
        if s.recv(1) != b"g":
            raise RuntimeError("the bench ended before the start")
    t0 = time.time()
    g = _form(system, rank, n, port)
    t1 = time.time()
    # (every process formed before any leaves: a group torn down while others still form
    # would fail them)
    if system == "ctrlcomm":
        g.barrier()
        g.close()
    elif system == "gloo":
        g.barrier()
        g.destroy_process_group()
    else:
        g.barrier()
    return t0, t1


def _starter(n: int, ls: socket.socket, out: dict[str, float], done: threading.Event) -> None:
    """Accept every process's connection (each is ready), then start them at once."""
    conns: list[socket.socket] = []
    try:
        ls.settimeout(1.0)
        while len(conns) < n and not done.is_set():
            try:
                c, _ = ls.accept()
            except TimeoutError:
                continue
            conns.append(c)
        out["go"] = time.time()
        for c in conns:
            c.sendall(b"g")
    finally:
        for c in conns:
            c.close()


def measure(system: str, n: int) -> float:
    """Seconds from every process of ``n`` ready to every one formed, for ``system``."""
    from ..testing import free_port, run_ranks

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(n)
    out: dict[str, float] = {}
    done = threading.Event()
    t = threading.Thread(target=_starter, args=(n, ls, out, done), daemon=True)
    t.start()
    try:
        res = run_ranks(_child, n, system, free_port(), ls.getsockname()[1],
                        timeout=900, fail_fast=True)
    finally:
        done.set()
        t.join(5)
        ls.close()
    return float(max(t1 for _, t1 in res) - out["go"])


def run(world_sizes: Sequence[int], systems: Sequence[str], repeat: int) -> list[dict[str, Any]]:
    """Rows of ``{"n", "system", "s": [seconds...]}``, every system at each size in turn."""
    import os

    # (torch's store clients warn, once per process, that a client socket has no host
    # name: 256 lines of it)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    mods = [MODULES[s] for s in systems]
    multiprocessing.set_forkserver_preload(["__main__", *mods])
    rows = []
    for n in world_sizes:
        for system in systems:
            took = [measure(system, n) for _ in range(repeat)]
            rows.append({"n": n, "system": system, "s": took})
            print(f"  n={n:<4} {system:<9} " + " ".join(f"{x:.3f}" for x in took) + " s",
                  flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Best of each, and each other system's over ctrlcomm's."""
    best = {(r["n"], r["system"]): min(r["s"]) for r in rows}
    sizes = sorted({r["n"] for r in rows})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    head = f"{'ranks':>6}  " + "  ".join(f"{s:>16}" for s in systems)
    lines = [head]
    for n in sizes:
        mine = best.get((n, "ctrlcomm"))
        cells = []
        for s in systems:
            v = best.get((n, s))
            cell = "-" if v is None else f"{v * 1000:.0f} ms"
            if v is not None and s != "ctrlcomm" and mine:
                cell += f" ({v / mine:.1f}x)"
            cells.append(f"{cell:>16}")
        lines.append(f"{n:>6}  " + "  ".join(cells))
    return "\n".join(lines)
