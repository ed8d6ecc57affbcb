"""Blocking collectives on Python objects: barrier, broadcast, all_reduce, all_gather,
send/recv, scatter/gather.

Run with 4 ranks (any number from 2 works):

    ctrlcomm run -n 4 -- python examples/collectives.py

``ctrlcomm run`` sets the ``CTRLCOMM_*`` variables that ``Group.from_env()`` reads and
prefixes each rank's lines with ``[rank]``. Each rank checks what it got; the script exits
with status 0 where every result is right.
"""

import ctrlcomm

# (a short timeout: a rank that never comes fails the run in seconds, not 300 s)
g = ctrlcomm.Group.from_env(timeout=30)
rank, n = g.rank, g.world_size

g.barrier()

# Only the root's object matters; the others pass None and get the root's.
cfg = g.broadcast({"lr": 3e-4, "layers": 12} if rank == 0 else None, src=0)
assert cfg == {"lr": 3e-4, "layers": 12}
print(f"broadcast {cfg}")

# Tuples reduce element-wise: one call for several counters.
total = g.all_reduce((rank + 1, rank * 10), op="sum")
biggest = g.all_reduce(rank * 10, op="max")
assert total == (n * (n + 1) // 2, 10 * n * (n - 1) // 2)
assert biggest == 10 * (n - 1)
print(f"all_reduce sum {total} max {biggest}")

sizes = g.all_gather(f"r{rank}")
assert sizes == [f"r{r}" for r in range(n)]
print(f"all_gather {sizes}")

# A ring: sends never wait for the matching recv, so every rank may send first.
g.send({"from": rank}, dst=(rank + 1) % n)
got = g.recv(src=(rank - 1) % n)
assert got == {"from": (rank - 1) % n}
print(f"recv {got}")

# scatter's objs matters only on src; gather's result exists only on dst.
mine = g.scatter([r * r for r in range(n)] if rank == 0 else None, src=0)
assert mine == rank * rank
back = g.gather(mine + 1, dst=0)
assert back == ([r * r + 1 for r in range(n)] if rank == 0 else None)
print(f"scatter {mine} gather {back}")

g.close()
print("done")
