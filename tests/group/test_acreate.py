"""Awaited formation: Group.acreate and Group.afrom_env form while the event loop goes on
(a ticker keeps ticking while a rank comes late), and a cancelled one leaves no group."""

import asyncio
import os
import time

import ctrlcomm
from ctrlcomm.testing import free_port, run_ranks


def forms_awaited(rank, size, port):
    async def main():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.002)

        t = asyncio.get_running_loop().create_task(ticker())
        if rank == 1:
            await asyncio.sleep(0.5)  # (rank 0 waits for it, awaiting)
        if rank == 2:
            os.environ.update(CTRLCOMM_HOST="127.0.0.1", CTRLCOMM_PORT=str(port),
                              CTRLCOMM_RANK="2", CTRLCOMM_WORLD_SIZE=str(size))
            g = await ctrlcomm.Group.afrom_env(name="aw", timeout=30)
        else:
            g = await ctrlcomm.Group.acreate("127.0.0.1", port, rank, size, name="aw",
                                             timeout=30)
        t.cancel()
        with g:
            return await g.aio.all_reduce(rank), len(ticks)

    return asyncio.run(main())


def test_formation_awaited_lets_the_loop_run():
    res = run_ranks(forms_awaited, 3, free_port())
    assert [r[0] for r in res] == [3, 3, 3]
    assert res[0][1] > 20, res  # (rank 0 waited 0.5 s for rank 1: its loop ticked on)


def cancelled(rank, size, port):
    async def main():
        task = asyncio.ensure_future(ctrlcomm.Group.acreate("127.0.0.1", port, 0, 2,
                                                            name="never", timeout=2))
        await asyncio.sleep(0.2)
        task.cancel()
        t = time.monotonic()
        try:
            await task
        except asyncio.CancelledError:
            return time.monotonic() - t
        return None

    return asyncio.run(main())


def test_a_cancelled_formation_ends_the_task_at_once():
    took = run_ranks(cancelled, 1, free_port())[0]
    assert took is not None and took < 1.0  # (formation's deadline: 2 s)
