"""The two modes of a world-2 call on this machine, blocking and awaited side by side.

``python benchmarks/world2_modes.py [ITERS] [BLOCKS] [barrier|all_reduce]``: two ranks (real
processes, a group over loopback) run BLOCKS blocks of ITERS calls, each block blocking then
awaited; per block it prints the median of the slowest rank's time per iteration, the share
of iterations under 30 us (the fast mode: neither rank slept, each found the other's message
there) and each rank's CPU per call. See benchmarks/README.md, "Where the world-8 time
goes, and why the world-2 targets cannot all hold here".
"""

import asyncio
import statistics
import sys
import time

from ctrlcomm.testing import run_group


def _blocks(g, iters, blocks, op):
    call = g.barrier if op == "barrier" else (lambda: g.all_reduce([1, 2]))
    acall = g.aio.barrier if op == "barrier" else (lambda: g.aio.all_reduce([1, 2]))

    async def awaited():
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            await acall()
            ts.append(time.perf_counter() - t0)
        return ts

    out = []
    for _ in range(blocks):
        ts = []
        c0 = time.process_time()
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        out.append(("blocking", ts, (time.process_time() - c0) / iters))
        c0 = time.process_time()
        ts = asyncio.run(awaited())
        out.append(("awaited", ts, (time.process_time() - c0) / iters))
    return out


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    op = sys.argv[3] if len(sys.argv) > 3 else "barrier"
    a, b = run_group(_blocks, 2, iters, blocks, op, timeout=600)
    for (kind, ta, ca), (_, tb, cb) in zip(a, b, strict=True):
        slowest = [max(x, y) * 1e6 for x, y in zip(ta, tb, strict=True)]
        fast = sum(t < 30 for t in slowest) / len(slowest)
        print(f"{op} {kind:8s} median {statistics.median(slowest):6.1f} us, "
              f"fast {fast:5.1%}, CPU per call {ca * 1e6:.1f} and {cb * 1e6:.1f} us")


if __name__ == "__main__":
    main()
