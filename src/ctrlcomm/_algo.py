"""Which algorithm each collective runs, by world size and payload size.

Chosen from ``ctrlcomm bench`` measurements (benchmarks/README.md), as MPI implementations
do. On the reference machine (2 cores, ranks on loopback) what costs is waking a process:
the star and flat variants wake every non-root rank once per call, the log-depth ones once
per round, so the former win up to :data:`SMALL_WORLD` ranks; above it the log-depth
algorithms run. The choice depends on the world size only, never on a rank's own payload:
every rank of a call must run the same algorithm, and only the root of a broadcast knows
what it sends. ``CTRLCOMM_ALGO="all_reduce=doubling,broadcast=tree"`` overrides the choice
per collective, and ``CTRLCOMM_SMALL_WORLD`` the threshold (set them alike on every rank; both
are read when ctrlcomm is imported, and each choice is made once per world size).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from . import _plans


def _small_world() -> tuple[int, str]:
    raw = os.environ.get("CTRLCOMM_SMALL_WORLD", "8")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        return 8, f"CTRLCOMM_SMALL_WORLD={raw!r} is not an int >= 1 (8 is used)"
    return n, ""


SMALL_WORLD, _SMALL_WORLD_PROBLEM = _small_world()

VARIANTS: dict[str, dict[str, Callable[..., _plans.Plan]]] = {
    "barrier": {"star": _plans.barrier_star, "dissemination": _plans.barrier},
    "broadcast": {"flat": _plans.broadcast_flat, "tree": _plans.broadcast},
    "gather": {"flat": _plans.gather_flat, "tree": _plans.gather},
    "scatter": {"flat": _plans.scatter_flat, "tree": _plans.scatter},
    "reduce": {"flat": _plans.reduce_flat, "tree": _plans.reduce},
    "all_reduce": {"flat": _plans.all_reduce_flat, "star": _plans.all_reduce_star,
                   "doubling": _plans.all_reduce_doubling},
    "all_gather": {"flat": _plans.all_gather_flat, "star": _plans.all_gather_star,
                   "bruck": _plans.all_gather_bruck},
}


def _overrides() -> tuple[dict[str, str], list[str]]:
    """CTRLCOMM_ALGO's choices, and what in it names no collective or algorithm (ignored)."""
    out, problems = {}, []
    for item in os.environ.get("CTRLCOMM_ALGO", "").split(","):
        if not item.strip():
            continue
        k, eq, v = (x.strip() for x in item.partition("="))
        if not eq:
            problems.append(f"{item.strip()!r} is not collective=algorithm")
        elif k not in VARIANTS:
            problems.append(f"{k!r} is not a collective ({', '.join(VARIANTS)})")
        elif v not in VARIANTS[k]:
            problems.append(f"{v!r} is not an algorithm of {k} ({', '.join(VARIANTS[k])})")
        else:
            out[k] = v
    return out, problems


OVERRIDES, _PROBLEMS = _overrides()


def setting_problems() -> list[str]:
    """What in CTRLCOMM_ALGO and CTRLCOMM_SMALL_WORLD was ignored, and why."""
    return [f"CTRLCOMM_ALGO: {p} (ignored)" for p in _PROBLEMS] + \
        ([_SMALL_WORLD_PROBLEM] if _SMALL_WORLD_PROBLEM else [])


_warned = [False]


@functools.lru_cache(maxsize=256)
def choose(op: str, n: int) -> Callable[..., _plans.Plan]:
    """The plan of collective ``op`` in a world of ``n`` ranks (the same for every call)."""
    if not _warned[0]:
        # a typo would silently run the default: said once, as the first collective is
        # planned (not at import: a command that refuses such a setting says so itself)
        _warned[0] = True
        if problems := setting_problems():
            import warnings

            warnings.warn("; ".join(problems), RuntimeWarning, stacklevel=3)
    variants = VARIANTS[op]
    forced = OVERRIDES.get(op)
    if forced in variants:
        return variants[forced]
    if n <= 2 and op in ("barrier", "all_reduce", "all_gather"):
        # one exchange, a single hop each way
        return variants["dissemination" if op == "barrier" else "flat"]
    if n <= SMALL_WORLD:
        return variants.get("star") or variants["flat"]
    return variants[{"barrier": "dissemination", "all_reduce": "doubling",
                     "all_gather": "bruck"}.get(op, "tree")]
