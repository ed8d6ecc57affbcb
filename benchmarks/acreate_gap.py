"""The event loop's longest gap while Group.acreate forms a group: a ticker task sleeps
1 ms in a loop on every rank; each rank reports its longest gap between ticks from the
call to the group formed (target: under 5 ms).

    python benchmarks/acreate_gap.py [WORLD] [REPEAT]
"""

import asyncio
import sys
import time

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks


def rank_fn(rank, size, port):
    async def main():
        ticks = [time.monotonic()]

        async def ticker():
            while True:
                await asyncio.sleep(0.001)
                ticks.append(time.monotonic())

        t = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0.01)
        start = len(ticks)
        g = await ctrlcomm.Group.acreate("127.0.0.1", port, rank, size, name="gap", timeout=60)
        seen = ticks[start - 1:]
        t.cancel()
        g.close()
        return max(b - a for a, b in zip(seen, seen[1:], strict=False)) if len(seen) > 1 else 0

    return asyncio.run(main())


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for _ in range(repeat):
        gaps = run_ranks(rank_fn, n, free_port())
        print(f"world {n}: longest loop gap per rank during acreate (ms): "
              + ", ".join(f"{g * 1000:.1f}" for g in gaps))


if __name__ == "__main__":
    main()
