"""Reusable, pytest-free helpers for testing code built on ctrlcomm.

- :func:`simulate` runs one collective plan for every rank of a world in memory, delivering
  messages in a random order, and fails on deadlock or stray messages.
- :func:`run_ranks` spawns real processes (one per rank) and collects their results.
- :func:`run_group` does the same with a :class:`ctrlcomm.Group` already formed in each rank.
- :func:`kill_ranks` kills ranks of a group (SIGKILL, as a crash) once all are in step, for
  testing what the others do then.
"""

from ._runner import RankFailedError as RankFailedError
from ._runner import free_port as free_port
from ._runner import kill_ranks as kill_ranks
from ._runner import run_group as run_group
from ._runner import run_ranks as run_ranks
from ._sim import DeadlockError as DeadlockError
from ._sim import SimResult as SimResult
from ._sim import simulate as simulate

__all__ = [
    "DeadlockError",
    "RankFailedError",
    "SimResult",
    "free_port",
    "kill_ranks",
    "run_group",
    "run_ranks",
    "simulate",
]
