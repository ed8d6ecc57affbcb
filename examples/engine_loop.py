"""An asyncio engine loop: each step, the ranks agree with one awaited all_reduce whether
anyone still has work, and stop together once all are idle. A ticker task runs beside it
the whole time; its longest gap shows the event loop was never blocked, not while the
group formed nor while a step waited for slower ranks.

Run with 4 ranks:

    ctrlcomm run -n 4 -- python examples/engine_loop.py
"""

import asyncio
import time

import ctrlcomm

TICK_S = 0.001


async def ticker(gaps: list[float]) -> None:
    last = time.perf_counter()
    while True:
        await asyncio.sleep(TICK_S)
        now = time.perf_counter()
        gaps.append(now - last - TICK_S)  # (the lateness: what a blocked loop adds)
        last = now


async def main() -> None:
    gaps: list[float] = []
    tick = asyncio.create_task(ticker(gaps))
    # (formation runs in the loop's executor: the ticker keeps going meanwhile)
    g = await ctrlcomm.Group.afrom_env(timeout=30)
    rank = g.rank
    # Each rank has a different amount of work, so ranks go idle at different steps: the
    # loop must keep stepping until the last one is done.
    queued, running = 2 * (rank + 1), 0
    step = 0
    while True:
        if running:
            running -= 1
        if queued:
            queued, running = queued - 1, running + 1
            # a forward pass; the last rank's first is long (a big prefill), so the others
            # wait 0.3 s in their all_reduce: a loop blocked there would show it in the ticker
            await asyncio.sleep(0.3 if step == 0 and rank == g.world_size - 1 else 0.002)
        # (sum, not max: the totals also say how much work the whole job has left)
        total_queued, total_running = await g.aio.all_reduce((queued, running), op="sum")
        step += 1
        if total_queued == total_running == 0:
            break
    tick.cancel()
    # (every rank stops at the same step: they all saw the same totals)
    steps = await g.aio.all_gather(step)
    assert len(set(steps)) == 1, steps
    assert step == 2 * g.world_size + 1, step
    g.close()
    print(f"idle after {step} steps; ticker ran {len(gaps)} ticks, longest gap "
          f"{max(gaps) * 1e3:.1f} ms")
    print("done")


asyncio.run(main())
