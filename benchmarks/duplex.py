"""A world-2 ping-pong two ways, side by side: one task that sends and then receives, and the
full-duplex pattern of an engine (a task that only receives, a task that only sends, handing
each other the turn through an ``asyncio.Queue``).

``python benchmarks/duplex.py [ITERS] [BLOCKS] [tcp|zmq] [both|single]``: two ranks (real
processes, a group over loopback) run BLOCKS blocks of ITERS round trips, each block
single-task then duplex; per block it prints rank 0's median round trip of each way, and at
the end the ratio duplex / single-task of the medians over all blocks (issue 48's bound: at
most 1.2). ``single``: the single-task way only (what a tree without full duplex runs, for
an A/B of the single-task way itself).
"""

import asyncio
import statistics
import sys
import time

from ctrlcomm.testing import run_group


async def _single(g, iters):
    other = 1 - g.rank
    ts = []
    for i in range(iters):
        t0 = time.perf_counter()
        if g.rank == 0:
            await g.aio.send(i, other)
            await g.aio.recv(other)
        else:
            await g.aio.send(await g.aio.recv(other), other)
        ts.append(time.perf_counter() - t0)
    return ts


async def _duplex(g, iters):
    other = 1 - g.rank
    turn: asyncio.Queue = asyncio.Queue()
    ts = []

    async def receiver():
        for _ in range(iters):
            turn.put_nowait(await g.aio.recv(other))

    async def sender():
        for i in range(iters):
            t0 = time.perf_counter()
            if g.rank == 0:
                await g.aio.send(i, other)
                await turn.get()  # (the receiver has the answer)
            else:
                await g.aio.send(await turn.get(), other)
            ts.append(time.perf_counter() - t0)

    await asyncio.gather(receiver(), sender())
    return ts


def _blocks(g, iters, blocks, ways):
    out = []
    for _ in range(blocks):
        for name, run in (("single", _single), ("duplex", _duplex)):
            if name not in ways:
                continue
            g.barrier()
            out.append((name, asyncio.run(run(g, iters))))
    return out


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    transport = sys.argv[3] if len(sys.argv) > 3 else "tcp"
    ways = ("single",) if len(sys.argv) > 4 and sys.argv[4] == "single" else ("single", "duplex")
    rank0, _ = run_group(_blocks, 2, iters, blocks, ways, timeout=600,
                         group_kwargs={"transport": transport})
    med: dict[str, list[float]] = {"single": [], "duplex": []}
    for name, ts in rank0:
        m = statistics.median(ts) * 1e6
        med[name].append(m)
        print(f"{name:7s} round trip median {m:7.1f} us  (p90 "
              f"{statistics.quantiles(ts, n=10)[-1] * 1e6:7.1f} us)")
    s = statistics.median(med["single"])
    if med["duplex"]:
        d = statistics.median(med["duplex"])
        print(f"{transport}: single-task {s:.1f} us, duplex {d:.1f} us, ratio {d / s:.2f} "
              f"(blocks {blocks} x {iters})")
    else:
        print(f"{transport}: single-task {s:.1f} us (blocks {blocks} x {iters})")


if __name__ == "__main__":
    main()
