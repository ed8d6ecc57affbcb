"""What a rank waiting for a late peer costs its host (issue 45's CPU and GIL targets).

World 2 on this host. Rank 1 sends N small objects, one every LATE_MS milliseconds; rank 0
receives them in its main thread while a second thread of its process counts in a loop.
For each configuration (``shm`` with its default spin, ``shm`` with ``spin_us=0``, ``tcp``,
and ``shm`` awaited) it reports:

- ``cpu``: the CPU time of rank 0's receiving thread (``time.thread_time``) over the wall
  time of its N receives: what waiting burns (target: at most 10 %);
- ``thread``: the counting thread's count per second meanwhile, over its count per second
  alone just before (target: at least 0.8): a wait that spins holding the GIL would take
  the other thread's turns.

``python benchmarks/shm_wait.py [N] [LATE_MS]`` (defaults 100, 10).
"""

import asyncio
import sys
import threading
import time

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks


def _count_for(seconds: float, stop: threading.Event | None = None) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while not stop.is_set() if stop is not None else time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    return n, time.perf_counter() - t0


def rank_main(rank: int, size: int, port: int, n: int, late: float, kw: dict, aio: bool):
    with ctrlcomm.Group.create("127.0.0.1", port, rank, size, name="late", timeout=60,
                               **kw) as g:
        g.barrier()
        if rank == 1:
            g.barrier()  # (rank 0 has counted alone: the late sends begin)
            for i in range(n):
                time.sleep(late)
                g.send(i, dst=0)
            g.barrier()
            return None
        alone, secs = _count_for(1.0)
        rate_alone = alone / secs
        stop = threading.Event()
        counted: list[tuple[int, float]] = []
        t = threading.Thread(target=lambda: counted.append(_count_for(0, stop)))
        g.barrier()  # (rank 1 starts sending)
        t.start()
        c0, w0 = time.thread_time(), time.perf_counter()
        if aio:
            async def recvs() -> None:
                for _ in range(n):
                    await g.aio.recv(src=1)
            asyncio.run(recvs())
        else:
            for _ in range(n):
                g.recv(src=1)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        stop.set()
        t.join()
        g.barrier()
        rate = counted[0][0] / counted[0][1]
        return cpu / wall, rate / rate_alone, wall / n


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    late = (float(sys.argv[2]) if len(sys.argv) > 2 else 10.0) / 1000
    configs = [("shm, default spin", {}, False), ("shm, spin_us=0", {"spin_us": 0}, False),
               ("tcp", {"transport": "tcp"}, False), ("shm, awaited", {}, True)]
    print(f"world 2, a peer {late * 1000:g} ms late, {n} receives; rank 0's receiving thread:")
    print(f"{'configuration':<20} {'cpu':>6} {'thread':>7} {'per recv':>9}")
    for name, kw, aio in configs:
        cpu, thread, per = run_ranks(rank_main, 2, free_port(), n, late, kw, aio, timeout=300)[0]
        print(f"{name:<20} {cpu * 100:5.1f}% {thread:7.2f} {per * 1000:7.2f}ms")


if __name__ == "__main__":
    main()
