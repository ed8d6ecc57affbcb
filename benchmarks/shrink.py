"""How long a shrink takes: from a kill -9 of one rank to every survivor holding the new
group, at a world size (default 16), over each transport asked for.

    python benchmarks/shrink.py [WORLD] [REPEAT]
"""

import os
import sys
import time

import ctrlcomm
from ctrlcomm.testing import free_port, kill_ranks, run_ranks


def rank_fn(rank, size, port, victim):
    g = ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="shrink", timeout=60)
    def stamp():  # (the victim: when it dies)
        with open(f"/tmp/ctrlcomm-shrink-{port}", "w") as f:
            f.write(repr(time.time()))

    kill_ranks(g, [victim], stamp)
    s = g.shrink()
    done = time.time()
    ok = s.all_reduce(1) == size - 1
    return done, ok


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for victim in (n // 2, 0):
        took = []
        for _ in range(repeat):
            port = free_port()
            res = run_ranks(rank_fn, n, port, victim, may_die=(victim,), timeout=120)
            path = f"/tmp/ctrlcomm-shrink-{port}"
            with open(path) as f:
                killed = float(f.read())
            os.unlink(path)
            outs = [r for r in res if r is not None]
            assert all(ok for _, ok in outs)
            took.append(max(d for d, _ in outs) - killed)
        print(f"world {n}, rank {victim} killed: kill -9 to every survivor's new group "
              + ", ".join(f"{t * 1000:.0f}" for t in took) + " ms")


if __name__ == "__main__":
    main()
