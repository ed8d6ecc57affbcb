"""A failure handled: one of 3 ranks dies mid-run; the survivors' next collective raises
``PeerLostError`` naming it within moments (a dead rank on this host is seen through its
process descriptor; on another host, after ``liveness_timeout``), never a hang. They then
``shrink()`` to a group of the ranks still alive and go on there.

Run with 3 ranks (any number from 3 works):

    ctrlcomm run -n 3 -- python examples/failure.py
"""

import os
import time

import ctrlcomm

DEAD = 1  # a middle rank, so that the shrunk group renumbers the rank after it

# Short deadlines, so that a bug shows as an error in seconds rather than a 300 s wait.
g = ctrlcomm.Group.from_env(timeout=10, liveness_timeout=2)
rank, n = g.rank, g.world_size

lost: list[int] = []
for step in range(5):
    if step == 3 and rank == DEAD:
        print(f"dying at step {step}")
        # (status 0 only so that `ctrlcomm run` reports the example as a success: it stops
        # every rank 3 s after one fails, as mpiexec does)
        os._exit(0)
    t = time.monotonic()
    try:
        total = g.all_reduce(1)
    except ctrlcomm.PeerLostError as e:  # (a GroupBrokenError: the group is unusable now)
        lost = e.ranks
        print(f"step {step}: {type(e).__name__} after {time.monotonic() - t:.2f} s, ranks lost "
              f"{lost}")
        break
    assert total == n, total
assert lost == [DEAD], lost

# Every survivor calls shrink() and gets the same group of the ranks still alive; the old
# group is of no more use.
new = g.shrink()
g.close()
assert new.world_size == n - 1
assert new.parent_ranks == [r for r in range(n) if r != DEAD]
print(f"shrunk: rank {rank} -> {new.rank} of {new.world_size}, parent_ranks {new.parent_ranks}")

total = new.all_reduce(1)
assert total == n - 1
print(f"all_reduce on the shrunk group: {total}")
new.close()
print("done")
