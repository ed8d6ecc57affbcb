"""A world-2 ping-pong two ways, side by side: one task that sends and then receives, and the
full-duplex pattern of an engine (a task that only receives, a task that only sends, handing
each other the turn through an ``asyncio.Queue``). The same two ways over a bare TCP
connection between the same two processes, with asyncio and no ctrlcomm, give the floor:
what the pattern itself costs (the hand-over between the tasks is one more turn of the event
loop per message).

``python benchmarks/duplex.py [ITERS] [BLOCKS] [tcp|zmq] [both|single]``: two ranks (real
processes, a group over loopback) run BLOCKS blocks of ITERS round trips, each block every
way in turn (ctrlcomm single-task, ctrlcomm duplex, bare single-task, bare duplex); it prints
rank 0's median round trip of each way, the median over the blocks, and the ratios duplex /
single-task (issue 48's bound: at most 1.2). ``single``: ctrlcomm's single-task way only
(what a tree without full duplex runs, for an A/B of that way itself).
"""

import asyncio
import socket
import statistics
import sys
import time

from ctrlcomm.testing import run_group

MSG = b"x" * 16


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


async def _bare_single(sock, rank, iters):
    loop = asyncio.get_running_loop()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            await loop.sock_sendall(sock, MSG)
            await loop.sock_recv(sock, len(MSG))
        else:
            await loop.sock_sendall(sock, await loop.sock_recv(sock, len(MSG)))
        ts.append(time.perf_counter() - t0)
    return ts


async def _bare_duplex(sock, rank, iters):
    loop = asyncio.get_running_loop()
    turn: asyncio.Queue = asyncio.Queue()
    ts = []

    async def receiver():
        for _ in range(iters):
            turn.put_nowait(await loop.sock_recv(sock, len(MSG)))

    async def sender():
        for _ in range(iters):
            t0 = time.perf_counter()
            if rank == 0:
                await loop.sock_sendall(sock, MSG)
                await turn.get()
            else:
                await loop.sock_sendall(sock, await turn.get())
            ts.append(time.perf_counter() - t0)

    await asyncio.gather(receiver(), sender())
    return ts


def _bare_connection(g):
    """A plain TCP connection between the two ranks (rank 1 listens: its port broadcast)."""
    if g.rank == 1:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        g.broadcast(ls.getsockname()[1], src=1)
        sock, _ = ls.accept()
        ls.close()
    else:
        sock = socket.create_connection(("127.0.0.1", g.broadcast(None, src=1)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


def _blocks(g, iters, blocks, ways):
    sock = _bare_connection(g) if "duplex" in ways else None
    runs = [("single", lambda: _single(g, iters)), ("duplex", lambda: _duplex(g, iters)),
            ("bare-single", lambda: _bare_single(sock, g.rank, iters)),
            ("bare-duplex", lambda: _bare_duplex(sock, g.rank, iters))]
    out = []
    for _ in range(blocks):
        for name, run in runs:
            if name in ways:
                g.barrier()
                out.append((name, asyncio.run(run())))
    if sock is not None:
        sock.close()
    return out


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    transport = sys.argv[3] if len(sys.argv) > 3 else "tcp"
    ways = ("single",) if len(sys.argv) > 4 and sys.argv[4] == "single" else (
        "single", "duplex", "bare-single", "bare-duplex")
    rank0, _ = run_group(_blocks, 2, iters, blocks, ways, timeout=600,
                         group_kwargs={"transport": transport})
    med: dict[str, list[float]] = {}
    for name, ts in rank0:
        m = statistics.median(ts) * 1e6
        med.setdefault(name, []).append(m)
        print(f"{name:12s} round trip median {m:7.1f} us  (p90 "
              f"{statistics.quantiles(ts, n=10)[-1] * 1e6:7.1f} us)")
    m = {k: statistics.median(v) for k, v in med.items()}
    print(f"{transport}: " + ", ".join(f"{k} {v:.1f} us" for k, v in m.items())
          + f" (blocks {blocks} x {iters})")
    if "duplex" in m:
        print(f"ratio duplex / single-task: ctrlcomm {m['duplex'] / m['single']:.2f}, bare "
              f"{m['bare-duplex'] / m['bare-single']:.2f}; what duplex adds: ctrlcomm "
              f"{m['duplex'] - m['single']:.1f} us, bare "
              f"{m['bare-duplex'] - m['bare-single']:.1f} us")


if __name__ == "__main__":
    main()
