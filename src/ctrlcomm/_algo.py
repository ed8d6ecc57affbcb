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

SMALL_WORLD = int(os.environ.get("CTRLCOMM_SMALL_WORLD", "8"))

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


def _overrides() -> dict[str, str]:
    out = {}
    for item in os.environ.get("CTRLCOMM_ALGO", "").split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
    return out


OVERRIDES = _overrides()


@functools.lru_cache(maxsize=256)
def choose(op: str, n: int) -> Callable[..., _plans.Plan]:
    """The plan of collective ``op`` in a world of ``n`` ranks (the same for every call)."""
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
